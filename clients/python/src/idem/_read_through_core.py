"""What the read-through twins share (``idem.read_through``): the lookup's
statement and the decoding of its row, and the asyncio helpers that leave a
Postgres call given up on to end in the background."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from idem import _spec
from idem.errors import PostgresError
from idem.types import StoredResponse
from idem.wire import STATUS_MAX, STATUS_MIN

log = logging.getLogger("idem")


def _lookup_sql() -> str:
    # The spec writes Postgres' $1; psycopg takes %s.
    sql: str = _spec.load("read_through.json")["lookup_sql"]
    return sql.replace("$1", "%s")


LOOKUP_SQL = _lookup_sql()
DEFAULT_TIMEOUT = _spec.load("read_through.json")["timeout_ms"] / 1000
SET_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"


@dataclass(frozen=True, slots=True)
class MirroredRecord:
    """A completed, unexpired row of the mirror."""

    fingerprint_hex: str
    """Lowercase hex SHA-256 of the fingerprint bytes sent to BEGIN."""
    response: StoredResponse


def decode_row(key: str, row: tuple[Any, ...]) -> MirroredRecord:
    """A row of ``LOOKUP_SQL``: fingerprint, status, body, flat headers."""
    fingerprint, status, body, flat = row
    if not isinstance(status, int) or not STATUS_MIN <= status <= STATUS_MAX:
        raise PostgresError(f"row for {key!r} has status {status!r}")
    items = [bytes(item) for item in (flat or [])]
    if len(items) % 2:
        raise PostgresError(f"row for {key!r} has an odd number of header items")
    headers = tuple(
        (items[i].decode("utf-8", "replace"), items[i + 1]) for i in range(0, len(items), 2)
    )
    return MirroredRecord(
        str(fingerprint).lower(), StoredResponse(status, bytes(body or b""), headers)
    )


def millis(timeout: float) -> str:
    return f"{max(1, round(timeout * 1000))}ms"


_BACKGROUND: set[asyncio.Task[Any]] = set()


async def settled_within(task: asyncio.Task[Any], timeout: float) -> bool:
    """Waits up to ``timeout`` for ``task``; a task still running then (or
    when the caller is cancelled) goes on in the background, kept until it
    ends and its error retrieved. Whether it ended in time."""
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        in_background(task)
        raise
    if not done:
        in_background(task)
    return bool(done)


def in_background(task: asyncio.Task[Any]) -> None:
    """Keeps ``task`` referenced until it ends; its failure is logged."""
    _BACKGROUND.add(task)
    task.add_done_callback(_ended)


def _ended(task: asyncio.Task[Any]) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.info("a Postgres call given up on ended with: %r", task.exception())
