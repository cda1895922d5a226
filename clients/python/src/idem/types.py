"""What ``IDEM.BEGIN`` decided, the stored response a replay hands back, and
the record ``IDEM.GET`` shows."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeAlias


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as ``IDEM.COMPLETE`` stores it."""

    status: int
    """HTTP status, 100..599."""
    body: bytes = b""
    headers: tuple[tuple[str, bytes], ...] = ()
    """``(name, value)`` pairs in the order they were stored; names may repeat."""

    @classmethod
    def of(
        cls, status: int, body: bytes | str = b"", headers: Iterable[tuple[str, bytes | str]] = ()
    ) -> StoredResponse:
        """A response from text or bytes."""
        as_bytes = body.encode() if isinstance(body, str) else bytes(body)
        return cls(
            status,
            as_bytes,
            tuple((n, v.encode() if isinstance(v, str) else bytes(v)) for n, v in headers),
        )


@dataclass(frozen=True, slots=True)
class New:
    """No record (or a takeover of a lapsed lease): the caller holds the key
    with ``token`` and must ``complete`` or ``abort`` it."""

    token: int


@dataclass(frozen=True, slots=True)
class InFlight:
    """Another holder's lease is alive; try again after ``retry_after_ms``."""

    retry_after_ms: int

    @property
    def retry_after(self) -> float:
        """The holder's remaining lease, in seconds."""
        return self.retry_after_ms / 1000


@dataclass(frozen=True, slots=True)
class Replay:
    """The key was completed: answer with the stored response."""

    response: StoredResponse

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def body(self) -> bytes:
        return self.response.body

    @property
    def headers(self) -> tuple[tuple[str, bytes], ...]:
        return self.response.headers


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key exists with another request fingerprint."""


Outcome: TypeAlias = New | InFlight | Replay | Mismatch
"""The module's decision for one ``IDEM.BEGIN``."""


class Origin(enum.Enum):
    """Where a completed response came from."""

    HANDLER = "handler"
    """Produced by the handler: the writer mirrors it to Postgres."""
    MIRROR = "mirror"
    """Read from Postgres (read-through, the fence): stored ``MIRRORED``."""


@dataclass(frozen=True, slots=True)
class Record:
    """An ``IDEM.GET`` answer. Times are Unix milliseconds; ``expires_at`` is
    ``None`` for a key without TTL."""

    state: Literal["in_progress", "completed"]
    fingerprint_hex: str
    """Lowercase hex SHA-256 of the fingerprint bytes sent to BEGIN."""
    token: int
    created_at: int
    expires_at: int | None
    lease_until: int | None = None
    """In progress: the holder's lease."""
    response: StoredResponse | None = None
    """Completed: the stored response."""
    completed_at: int | None = None
    mirror: Literal["pending", "mirrored"] | None = None


@dataclass(frozen=True, slots=True)
class PulledRecord:
    """One record of an ``IDEM.MIRROR.PULL`` answer."""

    key: bytes
    token: int
    fingerprint_hex: str
    response: StoredResponse
    created_at: int
    completed_at: int
    expires_at: int | None


@dataclass(frozen=True, slots=True)
class BeginOptions:
    """Options of one ``IDEM.BEGIN``, in seconds."""

    ttl: float
    """How long the key lives (sent as whole seconds, rounded up, at least 1)."""
    lease: float | None = None
    """The holder's lease; ``None`` uses the module's ``lease-ms`` config."""
    wait: float | None = None
    """Wait up to this long for the holder's answer instead of ``in_flight``."""
