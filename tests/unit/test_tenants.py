"""The tenants file: JSON or YAML, keys plain or as sha256 digests and held only as digests,
and every mistake refused with the tenant and the field it is in."""

from __future__ import annotations

import hashlib

import pytest

from common.tenants import TenantsError, parse

ACME = hashlib.sha256(b"sk-acme").hexdigest()


def test_json_and_yaml_read_alike_and_keys_are_found_by_their_digest() -> None:
    json_text = (
        '{"tenants": {"acme": {"api_keys": ["sk-acme"], "weight": 3, "models": ["m"]},'
        f' "beta": {{"api_keys": ["sha256:{hashlib.sha256(b"sk-beta").hexdigest()}"]}}}}}}'
    )
    yaml_text = f"""
tenants:
  acme: {{api_keys: [sk-acme], weight: 3, models: [m]}}
  beta:
    api_keys: ["sha256:{hashlib.sha256(b"sk-beta").hexdigest().upper()}"]
"""
    for text in (json_text, yaml_text):
        tenants = parse(text)
        assert tenants.of_key("sk-acme") == "acme" and tenants.of_key("sk-beta") == "beta"
        assert tenants.of_key("sk-nobody") is None
        assert tenants.by_name["acme"].weight == 3 and tenants.by_name["beta"].weight == 1
        assert "sk-acme" not in repr(tenants._by_digest)  # held as digests only
        assert bytes.fromhex(ACME) in tenants._by_digest


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"tenants": {"acme": {"api_keys": ["k"], "wieght": 2}}}', "tenants.acme.wieght"),
        (
            '{"tenants": {"acme": {"api_keys": ["k"], "tokens_per_minute": -5}}}',
            "tenants.acme.tokens_per_minute",
        ),
        ('{"tenants": {"acme": {"api_keys": ["k"], "weight": 0}}}', "tenants.acme.weight"),
        ('{"tenants": {"acme": {"api_keys": []}}}', "tenants.acme.api_keys"),
        ('{"tenants": {"acme": {"api_keys": ["sha256:abc"]}}}', "64 hexadecimal"),
        (
            '{"tenants": {"acme": {"api_keys": ["k"], "priorities": ["urgent"]}}}',
            "tenants.acme.priorities",
        ),
        (
            '{"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}',
            "tenants.b.api_keys: a key of tenant 'a'",
        ),
        (f'{{"tenants": {{"a": {{"api_keys": ["sk-acme", "sha256:{ACME}"]}}}}}}', "given twice"),
        ('{"tenants": {"a b": {"api_keys": ["k"]}}}', "tenants.a b"),
        ('{"tenant": {}}', "tenant"),
        ("tenants: [", "not JSON or YAML"),
    ],
)
def test_a_file_that_cannot_be_used_is_refused_naming_where(text: str, says: str) -> None:
    with pytest.raises(TenantsError, match=None) as caught:
        parse(text, "t.json")
    assert says in str(caught.value) and str(caught.value).startswith("t.json: ")
