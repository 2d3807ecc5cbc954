"""Tenants: who may call, and with what limits, read from one file (`--tenants PATH`).

    {"tenants": {"acme": {"api_keys": ["sk-acme", "sha256:9f86d0…"], "weight": 3,
                          "models": ["smollm"], "priorities": ["interactive", "batch"],
                          "max_timeout_ms": 60000, "requests_per_minute": 600,
                          "tokens_per_minute": 200000, "max_queued_tokens": 50000}}}

JSON or YAML, the same shape. Keys are given in plain text or as `sha256:` digests and held
only as digests: a presented key is hashed and looked up, so no plain key stays in memory and
the lookup compares digests, never the key. A file with an unknown field, a key given to two
tenants, or a limit out of range is refused with a message naming the tenant and the field.
`weight` and the per-minute and backlog quotas are read and checked here; this module holds
no enforcement (issue 38 builds it in steps: see docs/operations.md#tenants). Pure: parsing
and lookup, no I/O but `load`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import yaml  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

Priority = Literal["interactive", "batch", "background"]
DIGEST = "sha256:"


class TenantsError(ValueError):
    """A tenants file that cannot be used, with what is wrong and where."""


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    api_keys: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    weight: float = Field(default=1.0, gt=0, le=1000)
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_queued_tokens: int | None = Field(default=None, ge=1)
    max_timeout_ms: int | None = Field(default=None, ge=1)
    priorities: list[Priority] | None = None  # None: batch and background (interactive: listed)
    models: list[str] | None = None  # None: every model

    @field_validator("api_keys")
    @classmethod
    def _digests_well_formed(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if key.startswith(DIGEST) and not _is_hex_digest(key[len(DIGEST) :]):
                raise ValueError("a sha256: key needs 64 hexadecimal digits after the colon")
        return keys

    def digests(self) -> list[str]:
        return [digest_of_configured(k) for k in self.api_keys]


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], Tenant]


@dataclass(frozen=True, slots=True)
class Tenants:
    """The tenants and the digest of every key they hold."""

    by_name: dict[str, Tenant]
    _by_digest: dict[bytes, str]  # sha256 digest -> tenant name

    def of_key(self, key: str) -> str | None:
        """The tenant a presented key belongs to; None when no tenant holds it (every
        request of a tenant asks: the raw digest, not its hex)."""
        return self._by_digest.get(hashlib.sha256(key.encode()).digest())

    def __len__(self) -> int:
        return len(self.by_name)


NO_TENANTS = Tenants({}, {})


def digest_of_configured(key: str) -> str:
    """A configured key's sha256 hex digest: given as one, or computed from the plain key."""
    if key.startswith(DIGEST):
        return key[len(DIGEST) :].lower()
    return hashlib.sha256(key.encode()).hexdigest()


def parse(text: str, name: str = "tenants") -> Tenants:
    """Tenants from a file's text (JSON, or YAML, which JSON is a subset of)."""
    try:
        raw = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise TenantsError(f"{name}: not JSON or YAML: {exc}") from None
    try:
        parsed = TenantsFile.model_validate(raw)
    except ValidationError as exc:
        raise TenantsError(f"{name}: " + "; ".join(_where(e) for e in exc.errors())) from None
    owner: dict[str, str] = {}
    for tenant_name, tenant in parsed.tenants.items():
        digests = tenant.digests()
        if len(set(digests)) != len(digests):
            raise TenantsError(f"{name}: tenants.{tenant_name}.api_keys: a key given twice")
        for digest in digests:
            other = owner.setdefault(digest, tenant_name)
            if other != tenant_name:
                raise TenantsError(
                    f"{name}: tenants.{tenant_name}.api_keys: a key of tenant {other!r} too; "
                    "a key belongs to one tenant"
                )
    return Tenants(dict(parsed.tenants), {bytes.fromhex(d): t for d, t in owner.items()})


def load(path: Path) -> Tenants:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TenantsError(f"{path}: cannot be read: {exc.strerror}") from None
    return parse(text, str(path))


def _where(error: ErrorDetails) -> str:
    """One validation error as `tenants.<name>.<field>: what`."""
    location = ".".join(str(part) for part in error["loc"])
    return f"{location}: {error['msg']}"


def _is_hex_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)
