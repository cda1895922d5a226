"""What the sync and the asyncio client share: options, the ``PACKED``
switch, and the connection settings ``from_url`` applies."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from idem import _spec, wire
from idem.fingerprint import stored_hex
from idem.types import Mismatch, Outcome, Record, Replay, StoredResponse
from idem.wire import Duration

NEVER_DECODE = {"NEVER_DECODE": True}
"""redis-py's option to hand replies back as bytes whatever the client's
``decode_responses``: bodies are bytes."""


def default_call_timeout() -> float:
    """The Rust client's default bound on each call (spec/http.json)."""
    return float(_spec.http()["defaults"]["call_timeout_ms"]) / 1000


def connection_kwargs(call_timeout: float, kwargs: dict[str, Any], retry: Any) -> dict[str, Any]:
    """``from_url``'s settings: every call bounded by ``call_timeout``, and no
    retries inside redis-py (a BEGIN or COMPLETE whose reply was lost must
    surface as unavailable, not be sent again blindly)."""
    settings: dict[str, Any] = {
        "socket_timeout": call_timeout,
        "socket_connect_timeout": call_timeout,
        "retry": retry,
        "retry_on_timeout": False,
    }
    settings.update(kwargs)
    return settings


class PackedSwitch:
    """Whether BEGIN asks for packed replays: on until a module from before
    ``PACKED`` refuses the option, then off for good."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def turn_off(self) -> None:
        with self._lock:
            self._enabled = False


def begin_args(
    key: str,
    fingerprint: bytes,
    ttl: Duration,
    lease: Duration | None,
    wait: Duration | None,
    packed: bool,
) -> list[bytes]:
    return wire.begin_args(key, fingerprint, ttl, lease=lease, wait=wait, packed=packed)


def complete_args(key: str, token: int, response: StoredResponse, mirrored: bool) -> list[bytes]:
    _check_token(token)
    return wire.complete_args(key, token, response, mirrored=mirrored)


def _check_token(token: int) -> None:
    if not 0 < token < 1 << 63:
        raise ValueError(f"a token is positive and below 2^63: {token}")


def seconds(d: Duration) -> float:
    return d.total_seconds() if not isinstance(d, float | int) else float(d)


POLL_FIRST = 0.01
"""The library's waits: the first pause between two BEGINs (seconds)..."""
POLL_MAX = 0.2
"""...doubling up to this."""


def poll_pauses(deadline: float, clock: Callable[[], float]) -> Iterator[float]:
    """The pauses of a wait that polls BEGIN (the library does not block):
    growing from ``POLL_FIRST`` to ``POLL_MAX``, the last one ending at
    ``deadline``. The caller shortens each to the answer's retry-after."""
    pause = POLL_FIRST
    while (left := deadline - clock()) > 0:
        yield min(pause, left)
        pause = min(pause * 2, POLL_MAX)


class Watched:
    """What a watch of a record (the library's waits) makes of each ``GET``:
    the answer BEGIN would give once the record is completed (its response
    for this request, else a mismatch), or "ask BEGIN" when the record is
    gone or another holder took it over."""

    def __init__(self, fingerprint: bytes) -> None:
        self.expected = stored_hex(fingerprint)
        self.holder: int | None = None

    def judge(self, record: Record | None) -> tuple[bool, Outcome | None]:
        """(whether the watch ends, the shared answer when it has one)."""
        if record is None:
            return True, None
        if record.state == "completed" and record.response is not None:
            if record.fingerprint_hex == self.expected:
                return True, Replay(record.response)
            return True, Mismatch()
        if self.holder is None:
            self.holder = record.token
        return record.token != self.holder, None
