"""Request fingerprints, exactly as the Rust client's ``Fingerprinter``
computes them (spec/vectors/fingerprint.json): SHA-256 over a
length-prefixed framing of a version tag, the method, the request target
(path and query as sent), each configured header (name, count of values,
each value) and the body, tagged raw or canonical JSON."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from idem.canonical_json import canonicalize

FRAMING_TAG = b"idem-fingerprint-v1"
_BODY_RAW = b"\x00"
_BODY_CANONICAL_JSON = b"\x01"

Headers = Iterable[tuple[bytes | str, bytes | str]]
"""Request headers as ``(name, value)`` pairs in request order (ASGI's form)."""


def stored_hex(fingerprint: bytes) -> str:
    """Lowercase hex SHA-256 of fingerprint bytes: what the module and the
    Postgres mirror keep."""
    return hashlib.sha256(fingerprint).hexdigest()


class Fingerprint(bytes):
    """The 32 bytes sent to ``IDEM.BEGIN``."""

    @property
    def stored_hex(self) -> str:
        return stored_hex(self)


def _b(s: bytes | str) -> bytes:
    return s.encode("latin-1") if isinstance(s, str) else bytes(s)


class Fingerprinter:
    """Which parts of a request go into its fingerprint: method, target and
    body always; ``headers`` by name (all their values, in order; absent and
    empty differ); ``canonical_json`` canonicalizes JSON bodies (content type
    ``application/json`` or ``*/*+json``) so member order and whitespace do
    not matter."""

    __slots__ = ("canonical_json", "headers")

    def __init__(self, *, headers: Sequence[str] = (), canonical_json: bool = False) -> None:
        names: list[bytes] = []
        for name in headers:
            lowered = name.lower().encode("ascii")
            if lowered not in names:
                names.append(lowered)
        self.headers: tuple[bytes, ...] = tuple(names)
        self.canonical_json = canonical_json

    def __repr__(self) -> str:
        names = [n.decode() for n in self.headers]
        return f"Fingerprinter(headers={names!r}, canonical_json={self.canonical_json})"

    def fingerprint(
        self, method: str, target: bytes | str, headers: Headers, body: bytes
    ) -> Fingerprint:
        """The fingerprint of a request: ``target`` is the path and query as
        sent (``/payments?x=1``), ``headers`` the request's pairs in order."""
        names = self.headers
        # One pass over the headers: the configured ones' values in order,
        # and the first content type (for canonical JSON).
        values: dict[bytes, list[bytes]] = {}
        content_type: bytes | None = None
        if names or self.canonical_json:
            for n, v in headers:
                name = _b(n).lower()
                if name in names:
                    values.setdefault(name, []).append(_b(v))
                if content_type is None and name == b"content-type":
                    content_type = _b(v)
        # The framing is built whole and hashed in one update.
        parts = [FRAMING_TAG]
        _field(parts, method.encode("ascii"))
        _field(parts, target.encode() if isinstance(target, str) else bytes(target))
        parts.append(_count(len(names)))
        for name in names:
            found = values.get(name, ())
            _field(parts, name)
            parts.append(_count(len(found)))
            for value in found:
                _field(parts, value)
        canonical = self._canonical_body(content_type, body)
        if canonical is None:
            parts.append(_BODY_RAW)
            _field(parts, bytes(body))
        else:
            parts.append(_BODY_CANONICAL_JSON)
            _field(parts, canonical)
        return Fingerprint(hashlib.sha256(b"".join(parts)).digest())

    def _canonical_body(self, content_type: bytes | None, body: bytes) -> bytes | None:
        if not self.canonical_json:
            return None
        if content_type is None or not is_json_content_type(content_type):
            return None
        return canonicalize(body)


def is_json_content_type(value: bytes) -> bool:
    """``application/json`` or ``<type>/<subtype>+json`` (case-insensitive,
    parameters ignored); a value that is not visible ASCII is not read."""
    if not all(b == 0x09 or 0x20 <= b < 0x7F for b in value):
        return False
    essence = value.split(b";", 1)[0].strip(b" \t").lower()
    return essence == b"application/json" or (b"/" in essence and essence.endswith(b"+json"))


def downstream_key(key: str, fingerprint: bytes) -> str:
    """A key for a downstream API's own idempotency (a payment processor's
    ``Idempotency-Key``): hex SHA-256 over the key and the request
    fingerprint, the same for every attempt at this request, across retries
    and takeovers; the token is deliberately not part of it (docs/fence.md)."""
    raw = key.encode()
    framed = len(raw).to_bytes(8, "big") + raw + stored_hex(fingerprint).encode()
    return hashlib.sha256(framed).hexdigest()


def _count(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _field(parts: list[bytes], b: bytes) -> None:
    parts.append(len(b).to_bytes(8, "big"))
    parts.append(b)
