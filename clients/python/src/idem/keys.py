"""The ``Idempotency-Key`` header (a structured-field string such as
``"abc"`` or a bare token such as ``abc``), tenants, and the Redis key
derived from both (spec/vectors/keys.json)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from idem import _spec

MAX_KEY_BYTES = 255
"""Longest key accepted, in bytes (after unquoting)."""

MAX_TENANT_BYTES = 128
"""Longest tenant accepted, in bytes (its UTF-8; spec/http.json
``defaults.max_tenant_bytes``): with ``MAX_KEY_BYTES`` every Redis key the
middleware makes stays under the 2,048 bytes the writer's mirror takes."""

KeyErrorKind = Literal["empty", "too_long", "malformed", "repeated"]
TenantProblem = Literal["missing_tenant", "invalid_tenant"]


class InvalidKeyError(ValueError):
    """Why an ``Idempotency-Key`` header was rejected; ``detail`` is the
    400 problem's detail (spec/http.json)."""

    def __init__(self, kind: KeyErrorKind) -> None:
        self.kind: KeyErrorKind = kind
        self.detail: str = _spec.http()["key_errors"][kind]
        super().__init__(self.detail)


def parse_key(lines: Sequence[bytes]) -> str | None:
    """Every line of the header field; ``None`` when absent. More than one
    line is refused."""
    if not lines:
        return None
    if len(lines) > 1:
        raise InvalidKeyError("repeated")
    return parse_value(lines[0])


def parse_value(raw: bytes) -> str:
    """One header value: ``"sf-string"`` (with ``\\"`` and ``\\\\``
    escapes) or a bare run of visible ASCII without quotes, commas,
    semicolons or backslashes."""
    value = bytes(raw).strip(b" \t")
    if not value:
        raise InvalidKeyError("empty")
    key = _unquote(value) if value[:1] == b'"' else _bare(value)
    if not key:
        raise InvalidKeyError("empty")
    if len(key) > MAX_KEY_BYTES:
        raise InvalidKeyError("too_long")
    return key


def _unquote(value: bytes) -> str:
    out: list[str] = []
    i = 1
    while True:
        if i >= len(value):
            raise InvalidKeyError("malformed")
        c = value[i]
        i += 1
        if c == 0x22:
            break
        if c == 0x5C:
            if i >= len(value) or value[i] not in (0x22, 0x5C):
                raise InvalidKeyError("malformed")
            out.append(chr(value[i]))
            i += 1
        elif 0x20 <= c <= 0x7E:
            out.append(chr(c))
        else:
            raise InvalidKeyError("malformed")
    if i != len(value):
        raise InvalidKeyError("malformed")
    return "".join(out)


# Visible ASCII but the quote, comma, semicolon and backslash.
_BARE = re.compile(rb"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*")


def _bare(value: bytes) -> str:
    if not _BARE.fullmatch(value):
        raise InvalidKeyError("malformed")
    return value.decode("ascii")


def tenant_of_lines(lines: Sequence[bytes]) -> str | None:
    """A tenant header's lines as one tenant, combined as HTTP combines them
    (``a, b``); a value that is not UTF-8 becomes NUL plus its bytes in hex,
    a tenant no other value can name. ``None`` when the header is absent."""
    if not lines:
        return None
    combined = b", ".join(bytes(line) for line in lines)
    try:
        return combined.decode("utf-8")
    except UnicodeDecodeError:
        return "\0" + combined.hex()


class InvalidTenantError(ValueError):
    """A configured tenant source gave no tenant, an empty one
    (``missing_tenant``) or one over ``MAX_TENANT_BYTES``
    (``invalid_tenant``); ``problem`` names the 400 of spec/http.json."""

    def __init__(self, problem: TenantProblem) -> None:
        self.problem: TenantProblem = problem
        super().__init__(_spec.http()["problems"][problem]["detail"])


def check_tenant(tenant: str | None) -> str:
    """The tenant a configured source gave, checked: absent and empty are
    refused (they would share the anonymous scope), and so is one longer
    than ``MAX_TENANT_BYTES``; raises ``InvalidTenantError``."""
    if not tenant:
        raise InvalidTenantError("missing_tenant")
    if len(tenant.encode("utf-8", "surrogatepass")) > MAX_TENANT_BYTES:
        raise InvalidTenantError("invalid_tenant")
    return tenant


def redis_key(prefix: str, tenant: str, key: str) -> str:
    """``prefix{tenant:key}`` with ``%``, ``:``, ``{``, ``}`` and bytes
    outside visible ASCII percent-encoded in both parts: two tenants never
    share a key, and the hash tag is the whole pair."""
    return f"{prefix}{{{_encode(tenant)}:{_encode(key)}}}"


# A part that is all visible ASCII but ``%``, ``:``, ``{`` and ``}`` (nearly
# every key) is its own encoding.
_PLAIN = re.compile(r"[\x21-\x24\x26-\x39\x3b-\x7a\x7c\x7e]*")


def _encode(part: str) -> str:
    if _PLAIN.fullmatch(part):
        return part
    out = []
    for b in part.encode("utf-8", "surrogatepass"):
        if 0x21 <= b <= 0x7E and b not in b"%:{}":
            out.append(chr(b))
        else:
            out.append(f"%{b:02X}")
    return "".join(out)
