"""The module's wire protocol, as spec/vectors/commands.json and replies.json
describe it: the commands a client sends (argument order, duration rounding)
and strict readers of the replies (``IDEM.BEGIN`` in both layouts,
``IDEM.GET``, ``IDEM.MIRROR.PULL``, and the small ones). Anything that does
not have the documented shape raises ``UnexpectedReplyError``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from idem.errors import UnexpectedReplyError
from idem.types import (
    InFlight,
    Mismatch,
    New,
    Outcome,
    PulledRecord,
    Record,
    Replay,
    StoredResponse,
)

BEGIN = b"IDEM.BEGIN"
COMPLETE = b"IDEM.COMPLETE"
ABORT = b"IDEM.ABORT"
TOUCH = b"IDEM.TOUCH"
GET = b"IDEM.GET"
PACKED = b"PACKED"

STATUS_MIN, STATUS_MAX = 100, 599
_TRAILER = 10
_NO_EXPIRY = -1

Duration = float | timedelta
"""A duration: seconds, or a ``timedelta``."""


def _micros(d: Duration) -> int:
    if isinstance(d, timedelta):
        return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds
    if not math.isfinite(d) or d < 0:
        raise ValueError(f"a duration must be finite and not negative: {d!r}")
    return math.ceil(round(d * 1_000_000, 3))


def ttl_secs(ttl: Duration) -> int:
    """A TTL as IDEM.BEGIN's ttl-seconds: whole seconds rounded up, at least 1."""
    return max(1, -(-_micros(ttl) // 1_000_000))


def client_ms(d: Duration) -> int:
    """A lease, wait or TOUCH lease: whole milliseconds rounded up, at least 1."""
    return max(1, -(-_micros(d) // 1000))


def is_zero(d: Duration | None) -> bool:
    return d is None or _micros(d) == 0


def begin_args(
    key: str | bytes,
    fingerprint: bytes,
    ttl: Duration,
    *,
    lease: Duration | None = None,
    wait: Duration | None = None,
    packed: bool = False,
) -> list[bytes]:
    """``IDEM.BEGIN key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]``."""
    args = [BEGIN, _b(key), bytes(fingerprint), str(ttl_secs(ttl)).encode()]
    if lease is not None:
        args += [b"LEASE", str(client_ms(lease)).encode()]
    if not is_zero(wait):
        assert wait is not None
        args += [b"WAIT", str(client_ms(wait)).encode()]
    if packed:
        args.append(PACKED)
    return args


def complete_args(
    key: str | bytes, token: int, response: StoredResponse, *, mirrored: bool = False
) -> list[bytes]:
    """``IDEM.COMPLETE key token status body [HEADER name value]... [MIRRORED]``."""
    args = [COMPLETE, _b(key), str(token).encode(), str(response.status).encode(), response.body]
    for name, value in response.headers:
        args += [b"HEADER", name.encode(), bytes(value)]
    if mirrored:
        args.append(b"MIRRORED")
    return args


def abort_args(key: str | bytes, token: int) -> list[bytes]:
    return [ABORT, _b(key), str(token).encode()]


def touch_args(key: str | bytes, token: int, lease: Duration) -> list[bytes]:
    return [TOUCH, _b(key), str(token).encode(), str(client_ms(lease)).encode()]


def get_args(key: str | bytes) -> list[bytes]:
    return [GET, _b(key)]


def _b(s: str | bytes) -> bytes:
    return s.encode() if isinstance(s, str) else bytes(s)


# ---------------------------------------------------------------- readers


def _bad(what: str) -> UnexpectedReplyError:
    return UnexpectedReplyError(what)


def _bytes(v: Any, what: str) -> bytes:
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v)
    if isinstance(v, str):
        return v.encode()
    raise _bad(f"{what} is not a string: {v!r}")


def _text(v: Any, what: str) -> str:
    try:
        return _bytes(v, what).decode()
    except UnicodeDecodeError:
        raise _bad(f"{what} is not UTF-8") from None


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool):
        raise _bad(f"{what} is not an integer: {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, bytes | bytearray | str):
        text = v.decode() if isinstance(v, bytes | bytearray) else v
        if text.lstrip("-").isdigit() and text.isascii():
            return int(text)
    raise _bad(f"{what} is not an integer: {v!r}")


def _uint(v: Any, what: str) -> int:
    n = _int(v, what)
    if n < 0:
        raise _bad(f"{what} is negative")
    return n


def _positive(v: Any, what: str) -> int:
    n = _int(v, what)
    if n <= 0:
        raise _bad(f"{what} {n} is not positive")
    return n


def _array(v: Any, what: str) -> Sequence[Any]:
    if isinstance(v, list | tuple):
        return v
    raise _bad(f"{what} is not an array: {v!r}")


def _status(v: Any) -> int:
    s = _int(v, "status")
    if not STATUS_MIN <= s <= STATUS_MAX:
        raise _bad(f"status {s} out of range")
    return s


def _headers(v: Any) -> tuple[tuple[str, bytes], ...]:
    if v is None:
        return ()
    items = _array(v, "headers")
    if len(items) % 2:
        raise _bad("headers: odd number of items")
    return tuple(
        (
            _bytes(items[i], "header name").decode("utf-8", "replace"),
            _bytes(items[i + 1], "header value"),
        )
        for i in range(0, len(items), 2)
    )


def _expiry(v: Any) -> int | None:
    at = _int(v, "expires_at")
    if at == _NO_EXPIRY:
        return None
    if at < 0:
        raise _bad("expires_at is negative")
    return at


def _fingerprint_hex(v: Any) -> str:
    text = _text(v, "fingerprint")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise _bad("fingerprint is not hex") from None
    if len(raw) != 32:
        raise _bad("fingerprint is not 32 bytes")
    return raw.hex()


def unpack(packed: bytes) -> StoredResponse:
    """A ``PACKED`` replay: body | (name-len name value-len value)... |
    status (2) | header-count (4) | body-len (4), big-endian."""
    fields_end = len(packed) - _TRAILER
    if fields_end < 0:
        raise _bad("packed replay: shorter than its trailer")
    trailer = packed[fields_end:]
    status = int.from_bytes(trailer[0:2], "big")
    count = int.from_bytes(trailer[2:6], "big")
    body_len = int.from_bytes(trailer[6:10], "big")
    if not STATUS_MIN <= status <= STATUS_MAX:
        raise _bad(f"packed replay: status {status} out of range")
    if body_len > fields_end:
        raise _bad("packed replay: body runs past the headers")
    if count > (fields_end - body_len) // 8:
        raise _bad("packed replay: more headers than bytes")
    at = body_len
    headers: list[tuple[str, bytes]] = []
    for _ in range(count):
        pair: list[bytes] = []
        for what in ("name", "value"):
            if at + 4 > fields_end:
                raise _bad(f"packed replay: header {what} cut short")
            length = int.from_bytes(packed[at : at + 4], "big")
            end = at + 4 + length
            if end > fields_end:
                raise _bad(f"packed replay: header {what} cut short")
            pair.append(packed[at + 4 : end])
            at = end
        headers.append((pair[0].decode("utf-8", "replace"), pair[1]))
    if at != fields_end:
        raise _bad("packed replay: bytes left after the headers")
    return StoredResponse(status, packed[:body_len], tuple(headers))


def parse_begin(reply: Any) -> Outcome:
    """An ``IDEM.BEGIN`` reply, in either layout."""
    items = _array(reply, "BEGIN reply")
    if not items:
        raise _bad("empty BEGIN reply")
    tag, rest = _text(items[0], "BEGIN outcome"), items[1:]
    if tag == "new" and len(rest) == 1:
        return New(_positive(rest[0], "token"))
    if tag == "in_flight" and len(rest) == 1:
        return InFlight(_positive(rest[0], "retry_after"))
    if tag == "replay" and len(rest) == 1:
        return Replay(unpack(_bytes(rest[0], "packed replay")))
    if tag == "replay" and len(rest) == 3:
        return Replay(StoredResponse(_status(rest[0]), _bytes(rest[1], "body"), _headers(rest[2])))
    if tag == "mismatch" and not rest:
        return Mismatch()
    raise _bad(f"BEGIN outcome {tag!r} with {len(rest)} fields")


def parse_ok(reply: Any) -> None:
    if reply not in (b"OK", "OK", True):
        raise _bad(f"expected OK: {reply!r}")


def parse_abort(reply: Any) -> bool:
    if reply == 1 and not isinstance(reply, bool):
        return True
    if reply == 0 and not isinstance(reply, bool):
        return False
    raise _bad(f"ABORT reply: {reply!r}")


def parse_touch(reply: Any) -> int:
    """The remaining lease in ms."""
    return _uint(reply, "TOUCH reply")


_IN_PROGRESS = ("state", "fingerprint", "token", "created_at", "expires_at", "lease_until")
_COMPLETED = (
    "state",
    "fingerprint",
    "token",
    "created_at",
    "expires_at",
    "status",
    "body",
    "headers",
    "completed_at",
    "mirror",
)


def parse_record(reply: Any) -> Record | None:
    """An ``IDEM.GET`` reply, strictly: the documented fields in order."""
    if reply is None:
        return None
    items = _array(reply, "IDEM.GET reply")
    if len(items) % 2 or len(items) < 2 * len(_IN_PROGRESS):
        raise _bad("IDEM.GET reply has too few fields")
    names = tuple(_text(items[i], "field name") for i in range(0, len(items), 2))
    values = items[1::2]
    state = _text(values[0], "state")
    fingerprint_hex = _fingerprint_hex(values[1])
    token = _uint(values[2], "token")
    created_at = _uint(values[3], "created_at")
    expires_at = _expiry(values[4])
    if state == "in_progress" and names == _IN_PROGRESS:
        return Record(
            state="in_progress",
            fingerprint_hex=fingerprint_hex,
            token=token,
            created_at=created_at,
            expires_at=expires_at,
            lease_until=_uint(values[5], "lease_until"),
        )
    if state == "completed" and names == _COMPLETED:
        mirror = _text(values[9], "mirror")
        if mirror not in ("pending", "mirrored"):
            raise _bad(f"mirror {mirror!r}")
        return Record(
            state="completed",
            fingerprint_hex=fingerprint_hex,
            token=token,
            created_at=created_at,
            expires_at=expires_at,
            response=StoredResponse(
                _status(values[5]), _bytes(values[6], "body"), _headers(values[7])
            ),
            completed_at=_uint(values[8], "completed_at"),
            mirror="pending" if mirror == "pending" else "mirrored",
        )
    raise _bad(f"IDEM.GET state {state!r} with fields {names!r}")


def parse_pull(reply: Any) -> list[PulledRecord | UnexpectedReplyError]:
    """An ``IDEM.MIRROR.PULL`` reply; each entry read on its own, so one
    malformed entry (returned as its error) does not hide the others."""
    out: list[PulledRecord | UnexpectedReplyError] = []
    for entry in _array(reply, "PULL reply"):
        try:
            f = _array(entry, "PULL entry")
            if len(f) != 9:
                raise _bad(f"PULL entry has {len(f)} fields")
            out.append(
                PulledRecord(
                    key=_bytes(f[0], "key"),
                    token=_uint(f[1], "token"),
                    fingerprint_hex=_fingerprint_hex(f[2]),
                    response=StoredResponse(_status(f[3]), _bytes(f[4], "body"), _headers(f[5])),
                    created_at=_uint(f[6], "created_at"),
                    completed_at=_uint(f[7], "completed_at"),
                    expires_at=_expiry(f[8]),
                )
            )
        except UnexpectedReplyError as err:
            out.append(err)
    return out


def refuses_packed(err: BaseException) -> bool:
    """Whether a ``BADARG`` is a module from before ``PACKED`` refusing it."""
    from idem import _spec
    from idem.errors import BadArgError

    return isinstance(err, BadArgError) and err.detail == _spec.errors()["packed_refused_detail"]
