"""Who a caller is: plain `api_keys`, a tenants file's keys, or auth off, in one rule that
every route asks (`Services.authenticate`)."""

from __future__ import annotations

import pytest

from common.errors import Unauthorized
from common.tenants import NO_TENANTS, parse
from gateway.auth import authenticate

TENANTS = parse('{"tenants": {"acme": {"api_keys": ["sk-acme", "sk-shared"]}}}')


def test_with_no_keys_and_no_tenants_file_auth_is_off() -> None:
    assert authenticate(None, [], None) == (None, None)
    assert authenticate("Bearer anything", [], None) == (None, None)


@pytest.mark.parametrize("keys", [[], ["sk-plain"]])
def test_a_tenants_file_turns_auth_on_even_with_no_plain_keys(keys: list[str]) -> None:
    for tenants in (TENANTS, NO_TENANTS):  # a file with no tenant in it closes the API too
        for authorization in (None, "", "Bearer", "Bearer  ", "Basic sk-acme", "Bearer sk-x"):
            with pytest.raises(Unauthorized):
                authenticate(authorization, keys, tenants)


def test_a_tenant_s_key_names_its_tenant_and_a_plain_key_none() -> None:
    keys = ["sk-plain", "sk-shared"]
    assert authenticate("Bearer sk-acme", keys, TENANTS) == ("sk-acme", "acme")
    assert authenticate("bearer  sk-acme ", keys, TENANTS) == ("sk-acme", "acme")
    assert authenticate("Bearer sk-plain", keys, TENANTS) == ("sk-plain", None)
    # a plain key the file holds too is its tenant's
    assert authenticate("Bearer sk-shared", keys, TENANTS) == ("sk-shared", "acme")
    assert authenticate("Bearer sk-plain", keys, None) == ("sk-plain", None)
    with pytest.raises(Unauthorized):
        authenticate("Bearer sk-acme", keys, None)  # no file: a tenant's key is no key
