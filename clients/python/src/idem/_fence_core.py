"""What the fence's twins share (``idem.fence``): its statements and
answers, the decisions on a row, the report to the middleware and ``_Base``,
the fence's identity and settings."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import psycopg
from psycopg import pq

from idem import _spec
from idem._read_through_core import decode_row
from idem.errors import PostgresError
from idem.fingerprint import stored_hex
from idem.types import InFlight, Mismatch, Replay, StoredResponse
from idem.wire import Duration

_FENCE = _spec.load("fence.json")
_SQL: dict[str, str] = {name: s["sql"] for name, s in _FENCE["statements"].items()}
# What Rust's `build_transaction().isolation_level(ReadCommitted)` sends.
_SQL["read_committed"] = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
DEFAULT_LEASE = float(_spec.http()["defaults"]["lease_ms"]) / 1000
FENCE_RETRY_AFTER_MS = int(_spec.http()["defaults"]["fence_retry_after_ms"])

Layout = Literal["unpartitioned", "partitioned"]


@dataclass(frozen=True, slots=True)
class Proceed:
    """This holder holds the key: run the business logic, then ``commit``."""


Claim: TypeAlias = Proceed | Replay | InFlight | Mismatch
"""What a claim found. ``InFlight`` carries the fence's Retry-After (1 s)."""


@dataclass(frozen=True, slots=True)
class Committed:
    """The key's row holds the response (committed by ``commit``; by
    ``complete``, to commit with the transaction)."""


@dataclass(frozen=True, slots=True)
class Held:
    """``hold``: still held with this token, the lease renewed."""


@dataclass(frozen=True, slots=True)
class Lost:
    """This holder lost the key (its lease lapsed and a retry took it over,
    or the row was released): nothing may be committed; answer ``claim``."""

    claim: Replay | InFlight | Mismatch


def _in_flight() -> InFlight:
    return InFlight(FENCE_RETRY_AFTER_MS)


# ---------------------------------------------------------------- the report


_Kind = Literal["unused", "claimed_up_front", "claimed", "decided", "committed"]


class _Report:
    """What the handler did with its fence, as the middleware reads it.
    ``claimed_up_front``: the middleware claimed durably (through ``pool``)
    before the handler ran, and the handler has not used the fence yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.kind: _Kind = "unused"
        self.claim: Claim | None = None
        self.committed: StoredResponse | None = None
        self.pool: Any = None

    def set(
        self,
        kind: _Kind,
        *,
        claim: Claim | None = None,
        committed: StoredResponse | None = None,
        pool: Any = None,
    ) -> None:
        with self._lock:
            self.kind, self.claim, self.committed, self.pool = kind, claim, committed, pool

    def take_up_front(self) -> bool:
        """The handler takes over the claim made up front, if there is one:
        it is then reported as a claim made through its pool."""
        with self._lock:
            if self.kind != "claimed_up_front":
                return False
            self.kind = "claimed"
            return True


# ---------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class _Row:
    fingerprint_hex: str
    completed: bool
    token: int
    alive: bool
    response: StoredResponse | None


def _row(key: str, row: tuple[Any, ...] | None) -> _Row | None:
    if row is None:
        return None
    fingerprint, status, token, alive, response_status, body, headers = row
    completed = status == "completed"
    response = None
    if completed and response_status is not None:
        response = decode_row(key, (fingerprint, response_status, body, headers)).response
    return _Row(str(fingerprint).lower(), completed, int(token), bool(alive), response)


def decide(row: _Row | None, fingerprint_hex: str, token: int) -> Claim:
    """The decision on a row a claim did not take (docs/fence.md)."""
    if row is None:
        return _in_flight()  # deleted since (released, or cleaned up): ask again
    if not row.completed and row.token == token:
        return Proceed()  # claimed with this very token before
    if not row.alive:
        return _in_flight()  # expired, but a larger token has it
    if row.fingerprint_hex != fingerprint_hex:
        return Mismatch()
    if row.completed and row.response is not None:
        return Replay(row.response)
    return _in_flight()


def _lost(row: _Row | None, fingerprint_hex: str, token: int) -> Lost:
    claim = decide(row, fingerprint_hex, token)
    return Lost(_in_flight() if isinstance(claim, Proceed) else claim)


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else str(max(1, round(seconds * 1000)))


def _seconds(d: Duration) -> float:
    return d if isinstance(d, float | int) else d.total_seconds()


def _flat(response: StoredResponse) -> list[bytes]:
    return [x for name, value in response.headers for x in (name.encode(), value)]


# How the completion fails when asked to (``fail_when_not_held``) and the row
# is not held: spec/fence.json, ``not_held``.
NOT_HELD_SQLSTATE: str = _FENCE["not_held"]["sqlstate"]
NOT_HELD_MESSAGE: str = _FENCE["not_held"]["message_contains"]


_UNFAILED = (
    "the completion answered 'not held' instead of failing (spec/fence.json's complete "
    "ignores fail_when_not_held?): its COMMIT went through"
)


_EFFECT_SPEC: dict[str, Any] = _FENCE["statements"]["complete_with_effect"]
EFFECT_FIRST_PARAM: int = int(_EFFECT_SPEC["effect_first_param"])
"""The number of the first of ``commit_effect``'s parameters (``$7``): the
fence's own come first."""
_EFFECT_VERB = re.compile(r"[A-Za-z]*")
_EFFECT_VERBS = ("insert", "update", "delete")

_EFFECT_UNFAILED = (
    "the completion with the effect answered 'not held' instead of failing (spec/fence.json's "
    "complete_with_effect changed?): its effect committed"
)


def _effect_statement(effect: str) -> str:
    """spec/fence.json's ``complete_with_effect`` with ``effect`` in place of
    its placeholder: ``effect`` trimmed, a trailing semicolon dropped, and
    refused (``ValueError``) unless its first word is INSERT, UPDATE or
    DELETE (a SELECT there would never run)."""
    trimmed = effect.strip().rstrip(";").rstrip()
    verb = _EFFECT_VERB.match(trimmed)
    if verb is None or verb.group().lower() not in _EFFECT_VERBS:
        raise ValueError(
            "the fenced effect must be one INSERT, UPDATE or DELETE statement, "
            f"not {trimmed[:40]!r}"
        )
    return _SQL["complete_with_effect"].replace(_EFFECT_SPEC["effect_placeholder"], trimmed, 1)


def _not_held(err: BaseException) -> bool:
    """Whether ``err`` is, or was raised while handling, the completion's
    "not held" failure: psycopg's pipeline may report the skipped ``COMMIT``
    (``PipelineAborted``) with the completion's error as its context."""
    seen: BaseException | None = err
    while seen is not None:
        if (
            isinstance(seen, psycopg.Error)
            and seen.sqlstate == NOT_HELD_SQLSTATE
            and NOT_HELD_MESSAGE in str(seen)
        ):
            return True
        seen = seen.__context__
    return False


# How a completion fails when a takeover moved the row on the partitioned
# layout: spec/fence.json, ``moved``.
MOVED_SQLSTATE: str = _FENCE["moved"]["sqlstate"]


def _moved(err: BaseException) -> bool:
    """Whether ``err`` is, or was raised while handling, a serialization
    failure (40001): on the partitioned layout, what a completion waiting for
    the gate meets when a takeover moved the row to another partition
    meanwhile (under READ COMMITTED too)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, psycopg.Error) and seen.sqlstate == MOVED_SQLSTATE:
            return True
        seen = seen.__context__
    return False


def _pipelined() -> bool:
    """Whether ``commit`` sends the completion and ``COMMIT`` together
    (psycopg's pipeline mode needs a libpq 14 or later)."""
    return psycopg.Pipeline.is_supported()


def _held(row: tuple[Any, ...] | None) -> bool:
    """The completion's or renewal's answer: its one row, ``held``."""
    if row is None or not isinstance(row[0], bool):
        raise PostgresError(f"the fence's statement answered {row!r}, not (held)")
    return row[0]


_PARTITIONED_ISOLATION = "read committed"


def _claim_error(err: psycopg.Error) -> PostgresError:
    """The unpartitioned claim's ``ON CONFLICT (key)`` on a partitioned table
    has no unique index to use (42P10): say which fence to use."""
    if err.sqlstate == "42P10":
        return PostgresError(f"{err}: idempotency_keys looks partitioned; use layout='partitioned'")
    return PostgresError(str(err))


class _Base:
    """What both twins share: the fence's identity and settings."""

    def __init__(
        self,
        key: str,
        token: int,
        fingerprint: bytes,
        ttl: Duration,
        *,
        lease: Duration = DEFAULT_LEASE,
        idle_timeout: Duration | Literal["lease"] | None = "lease",
        layout: Layout = "unpartitioned",
    ) -> None:
        if not 0 < token < 1 << 63:
            raise ValueError("a fencing token is positive and below 2^63")
        self.key = key
        self.token = token
        self.fingerprint_hex = stored_hex(bytes(fingerprint))
        self.ttl = _seconds(ttl)
        self.lease = _seconds(lease)
        self.idle_timeout = (
            self.lease if idle_timeout == "lease" else None if idle_timeout is None
            else _seconds(idle_timeout)
        )  # fmt: skip
        self.layout = layout
        self._report: _Report | None = None

    def downstream_key(self) -> str:
        """A key for a downstream API's own idempotency (a processor's
        ``Idempotency-Key``): the same for every attempt at this request."""
        return downstream_key_of(self.key, self.fingerprint_hex)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key={self.key!r}, token={self.token}, ttl={self.ttl}, "
            f"lease={self.lease}, layout={self.layout!r})"
        )

    def _claim_params(self, synchronous_commit: str | None, idle: str | None) -> list[Any]:
        return [
            self.key, self.fingerprint_hex, self.token, self.ttl, self.lease,
            synchronous_commit, idle,
        ]  # fmt: skip

    def _complete_params(self, response: StoredResponse, fail_when_not_held: bool) -> list[Any]:
        return [
            self.key, self.token, response.status, response.body, _flat(response),
            _ms(self.idle_timeout), fail_when_not_held,
        ]  # fmt: skip

    def _effect_params(self, response: StoredResponse, params: Sequence[Any]) -> list[Any]:
        """``complete_with_effect``'s parameters in the spec's order (the
        completion's, by name), then the effect's."""
        named = dict(zip(_FENCE["statements"]["complete"]["params"],
                         self._complete_params(response, True), strict=True))  # fmt: skip
        return [named[name] for name in _EFFECT_SPEC["params"]] + list(params)

    def _renew_params(self) -> list[Any]:
        return [self.key, self.token, self.lease, _ms(self.idle_timeout)]

    def _decided(self, row: tuple[Any, ...] | None) -> Lost:
        """The answer of a write that found the row not held: what it holds."""
        lost = _lost(_row(self.key, row), self.fingerprint_hex, self.token)
        self._set("decided", claim=lost.claim)
        return lost

    def _failed(self, err: BaseException, row: tuple[Any, ...] | None) -> Lost | None:
        """The answer of a completion that failed, ``row`` read once its
        transaction ended: ``Lost`` when it failed as not held, or as moved
        (40001) and the row is no longer this holder's; ``None`` (raise the
        error) when a serialization failure left the row this holder's."""
        if not _not_held(err):
            claim = decide(_row(self.key, row), self.fingerprint_hex, self.token)
            if isinstance(claim, Proceed):
                return None
        return self._decided(row)

    def _reported(self, result: Committed | Lost, response: StoredResponse) -> Committed | Lost:
        """``result`` of a commit of ``response``, told to the middleware
        when committed (a Lost was told by ``_decided``)."""
        if isinstance(result, Committed):
            self._set("committed", committed=response)
        return result

    @staticmethod
    def _committable(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
        """``commit`` ends the connection's transaction with its own
        ``COMMIT``, sent in a pipeline of its own: refused inside the caller's
        ``conn.pipeline()`` block (the caller's statements would share its
        Sync, and its failure) and inside a ``conn.transaction()`` block
        (psycopg would then commit or release a savepoint on a transaction
        already ended), before anything is sent."""
        if conn.info.pipeline_status != pq.PipelineStatus.OFF:
            raise PostgresError(
                "commit sends the completion and COMMIT in a pipeline of its own: call it "
                f"outside conn.pipeline() (the connection is in pipeline mode, "
                f"{conn.info.pipeline_status.name})"
            )
        if getattr(conn, "_num_transactions", 0):
            raise PostgresError(
                "commit ends the connection's transaction: call it outside conn.transaction() "
                "(or use complete inside it)"
            )

    @staticmethod
    def _autocommittable(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
        """``commit_effect`` runs its statement on its own, autocommitted:
        refused, before anything is sent, on a connection inside a
        transaction (the statement would commit or roll back with that
        transaction, not on its own) or in pipeline mode."""
        if conn.info.pipeline_status != pq.PipelineStatus.OFF:
            raise PostgresError(
                "commit_effect runs one statement on its own: call it outside conn.pipeline()"
            )
        status = conn.info.transaction_status
        if status != pq.TransactionStatus.IDLE:
            raise PostgresError(
                "commit_effect needs a connection outside any transaction "
                f"(the connection is {status.name})"
            )

    def _taken_up_front(self) -> bool:
        """Whether the middleware claimed the key before the handler ran
        (``claim_up_front``) and the handler had not used the fence yet: it
        now holds that claim (released by the middleware unless committed)."""
        return self._report is not None and self._report.take_up_front()

    def _set(self, kind: _Kind, **kw: Any) -> None:
        if self._report is not None:
            self._report.set(kind, **kw)

    @staticmethod
    def _in_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
        """Refuses a connection whose statements would not run in one
        transaction (an autocommit connection outside ``conn.transaction()``,
        or one failed or busy): there the gate a write takes ends with its
        statement and a ``Lost`` holder's rollback undoes nothing. A
        connection that is not autocommit, outside a transaction, is taken:
        psycopg opens the transaction at the first statement."""
        status = conn.info.transaction_status
        if status == pq.TransactionStatus.INTRANS:
            return
        if status == pq.TransactionStatus.IDLE and not conn.autocommit:
            return
        raise PostgresError(
            "the fence writes only in a transaction: use conn.transaction() on an "
            f"autocommit connection (the connection is {status.name})"
        )

    def _after_claim(self, claim: Claim, pool: Any = None) -> Claim:
        if isinstance(claim, Proceed):
            self._set("claimed", pool=pool)
        else:
            self._set("decided", claim=claim)
        return claim


def downstream_key_of(key: str, fingerprint_hex: str) -> str:
    """``idem.downstream_key`` from the fingerprint's stored hex."""
    raw = key.encode()
    framed = len(raw).to_bytes(8, "big") + raw + fingerprint_hex.encode()
    return hashlib.sha256(framed).hexdigest()
