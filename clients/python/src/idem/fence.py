"""The Postgres fence (docs/fence.md; the Rust ``idem_client::Fence``): a
key's idempotency row is claimed durably (a short statement of its own,
with a lease) before the handler calls anything outside Postgres, and
completed in the short transaction that writes the business effect, only
while it is still held with the claim's token. The effect and the
authoritative record commit or roll back together whatever Redis forgets,
and no transaction spans a foreign call.

The statements are the Rust crate's, read from spec/fence.json (the Rust
tests assert that file equals its constants) and run as written, with
Postgres' own ``$n`` parameters.

``commit`` sends the completion (asked to fail when the row is not held) and
``COMMIT`` in one round trip, in psycopg's pipeline mode: a completion that
fails aborts the transaction and the server skips the ``COMMIT`` up to the
pipeline's Sync, so nothing commits; the transaction is then rolled back
and the row read outside it. On the partitioned layout a takeover that moved
the row to another partition while the completion waited for the gate fails
it with a serialization failure (40001): the same, unless the row is still
this holder's (then the error). Where pipeline mode is unavailable (a libpq
older than 14) it runs them one after the other (the completion answering
``held``, a ``ROLLBACK`` when it is not).

``commit_effect`` is ``commit`` without a transaction, for an effect that is
one INSERT, UPDATE or DELETE whose values (and so the response) are known
before it runs: spec/fence.json's ``complete_with_effect`` with the effect in
place of its placeholder, one autocommitted statement (one round trip, no
``BEGIN`` or ``COMMIT``) that commits the completion and the effect together
or neither.

``Fence`` works on psycopg connections and ``ConnectionPool``\\s;
``AsyncFence`` is its asyncio twin.

Claims answer ``Proceed()``, ``Replay(response)``, ``InFlight(...)`` or
``Mismatch()``; ``complete``/``commit``/``commit_effect`` answer
``Committed()`` or ``Lost(claim)``; ``hold`` answers ``Held()`` or ``Lost(claim)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import psycopg
import psycopg_pool
from psycopg import pq

from idem import _spec
from idem.errors import PostgresError
from idem.fingerprint import stored_hex
from idem.read_through import decode_row
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


class Fence(_Base):
    """The fence of one request over psycopg (sync)."""

    def _raw(self, conn: psycopg.Connection[Any], name: str, params: list[Any]) -> Any:
        cursor = psycopg.RawCursor(conn)
        cursor.execute(_SQL[name], params)
        return cursor

    def _settle(self, conn: psycopg.Connection[Any], free: bool, claimed: bool) -> Claim:
        if claimed:
            return Proceed()
        if not free:
            return _in_flight()
        row = self._raw(conn, "row", [self.key]).fetchone()
        return decide(_row(self.key, row), self.fingerprint_hex, self.token)

    def _claim_on(self, conn: psycopg.Connection[Any], sync: str | None, idle: str | None) -> Claim:
        if self.layout == "unpartitioned":
            free, claimed = self._raw(conn, "claim", self._claim_params(sync, idle)).fetchone()
            return self._settle(conn, free, claimed)
        free, isolation, *_ = self._raw(conn, "partitioned_gate", [self.key, sync, idle]).fetchone()
        if isolation != _PARTITIONED_ISOLATION:
            raise PostgresError(
                f"the partitioned fence needs a READ COMMITTED transaction, not {isolation}"
            )
        if not free:
            return _in_flight()
        (claimed,) = self._raw(
            conn, "partitioned_claim", self._claim_params(sync, idle)[:5]
        ).fetchone()
        return self._settle(conn, True, claimed)

    def claim(self, source: psycopg_pool.ConnectionPool[Any] | psycopg.Connection[Any]) -> Claim:
        """Claims the key durably: the ``in_progress`` row, with this token
        and a lease, commits on its own before this returns. Call anything
        outside Postgres now (with ``downstream_key``), then ``commit`` the
        effect in a short transaction."""
        if self._taken_up_front():
            return Proceed()
        pool = source if isinstance(source, psycopg_pool.ConnectionPool) else None
        try:
            if pool is not None:
                with pool.connection() as conn:
                    claim = self._durably(conn)
            else:
                assert isinstance(source, psycopg.Connection)
                claim = self._durably(source)
        except psycopg.Error as err:
            raise _claim_error(err) from err
        return self._after_claim(claim, pool)

    def _durably(self, conn: psycopg.Connection[Any]) -> Claim:
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            raise PostgresError("a durable claim needs a connection outside any transaction")
        if self.layout == "unpartitioned":
            if conn.autocommit:
                return self._claim_on(conn, "off", None)  # one statement, committed on its own
            with conn.transaction():
                return self._claim_on(conn, "off", None)
        # The partitioned layout's two statements: a short transaction of
        # their own at READ COMMITTED whatever the default, holding the gate
        # no longer than the idle timeout should the claimer vanish.
        with conn.transaction():
            self._raw(conn, "read_committed", [])
            return self._claim_on(conn, "off", _ms(self.idle_timeout))

    def claim_in(self, conn: psycopg.Connection[Any]) -> Claim:
        """Claims the key inside the caller's open transaction on ``conn``
        (effects only in Postgres: claim, effect and completion commit
        together; its rollback undoes the claim)."""
        if self._taken_up_front():
            return Proceed()
        self._in_transaction(conn)
        try:
            claim = self._claim_on(conn, None, _ms(self.idle_timeout))
        except psycopg.Error as err:
            raise _claim_error(err) from err
        return self._after_claim(claim)

    def _write(self, conn: psycopg.Connection[Any], name: str, params: list[Any]) -> Held | Lost:
        """A fenced write (the completion with ``fail_when_not_held`` false,
        the renewal) in the caller's transaction; not held: the row read in
        it, ``Lost``."""
        if _held(self._raw(conn, name, params).fetchone()):
            return Held()
        return self._decided(self._raw(conn, "row", [self.key]).fetchone())

    def complete(self, conn: psycopg.Connection[Any], response: StoredResponse) -> Committed | Lost:
        """Writes the response into the key's row in the caller's open
        transaction, if this holder still holds it; on ``Lost`` roll back.
        ``conn`` must be in a transaction (see ``_in_transaction``)."""
        self._in_transaction(conn)
        try:
            written = self._write(conn, "complete", self._complete_params(response, False))
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return Committed() if isinstance(written, Held) else written

    def commit(self, conn: psycopg.Connection[Any], response: StoredResponse) -> Committed | Lost:
        """Completes the key's row and commits the connection's transaction
        (write the effect in it first) in one round trip, and tells the
        middleware; on ``Lost`` nothing is committed. ``conn`` must not be
        inside a ``with conn.transaction()`` or ``with conn.pipeline()``
        block. Whatever happens, the connection is left outside any
        transaction."""
        self._committable(conn)
        self._in_transaction(conn)
        try:
            if _pipelined():
                result = self._commit_pipelined(conn, response)
            else:
                result = self._commit_sequential(conn, response)
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return self._reported(result, response)

    def _commit_pipelined(
        self, conn: psycopg.Connection[Any], response: StoredResponse
    ) -> Committed | Lost:
        try:
            with conn.pipeline():
                # Sent as queued, then one Sync at the block's end: one round
                # trip (``conn.commit()`` would sync, and the block's end sync
                # again). A failed completion makes the server skip the COMMIT.
                completion = self._raw(conn, "complete", self._complete_params(response, True))
                psycopg.RawCursor(conn).execute("COMMIT", prepare=False)
        except BaseException as err:
            # The transaction is aborted (the COMMIT skipped) or already
            # ended (the COMMIT failed): nothing of it committed.
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
            if not (_not_held(err) or _moved(err)):
                raise
            row = self._raw(conn, "row", [self.key]).fetchone()
            conn.rollback()  # ends the read's transaction (non-autocommit)
            lost = self._failed(err, row)
            if lost is None:
                raise
            return lost
        # The completion answered: held (a row not held fails it), committed.
        if not _held(completion.fetchone()):
            raise PostgresError(_UNFAILED)
        return Committed()

    def _commit_sequential(
        self, conn: psycopg.Connection[Any], response: StoredResponse
    ) -> Committed | Lost:
        try:
            result = self._write(conn, "complete", self._complete_params(response, False))
            if isinstance(result, Lost):
                conn.rollback()
                return result
            conn.commit()
        except BaseException as err:
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
            if not _moved(err):
                raise
            # Moved by a takeover (see ``_moved``): the row read once the
            # transaction is rolled back, as in ``_commit_pipelined``.
            row = self._raw(conn, "row", [self.key]).fetchone()
            conn.rollback()
            lost = self._failed(err, row)
            if lost is None:
                raise
            return lost
        return Committed()

    def commit_effect(
        self,
        source: psycopg_pool.ConnectionPool[Any] | psycopg.Connection[Any],
        response: StoredResponse,
        effect: str,
        params: Sequence[Any] = (),
    ) -> Committed | Lost:
        """``commit`` without a transaction, for an effect that is one
        INSERT, UPDATE or DELETE and a response known before it runs (ids
        reserved ahead, the application's clock): the completion and
        ``effect`` commit together in one autocommitted statement, one round
        trip, and the middleware is told; number the effect's parameters from
        ``$7`` (``EFFECT_FIRST_PARAM``; ``$1`` is the key). On ``Lost``
        nothing is committed, the effect neither. An effect that fails (a
        constraint) fails the completion with it: the error is raised, the
        key still held. Another effect is refused with ``ValueError``, and a
        connection inside a transaction with ``PostgresError``, before
        anything is sent. A connection that is not autocommit runs the
        statement in autocommit all the same (switched back after, no
        transaction left open); through a pool, a connection is taken for
        the call only. The completion commits whatever rows the effect
        wrote, none included: an effect that may write none (a conditional
        UPDATE, ON CONFLICT DO NOTHING) belongs in ``commit``'s transaction,
        where the handler sees the row count first."""
        sql = _effect_statement(effect)
        try:
            if isinstance(source, psycopg_pool.ConnectionPool):
                with source.connection() as conn:
                    result = self._commit_effect_on(conn, sql, response, params)
            else:
                result = self._commit_effect_on(source, sql, response, params)
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return self._reported(result, response)

    def _commit_effect_on(
        self,
        conn: psycopg.Connection[Any],
        sql: str,
        response: StoredResponse,
        params: Sequence[Any],
    ) -> Committed | Lost:
        self._autocommittable(conn)
        switched = not conn.autocommit
        if switched:
            conn.autocommit = True  # no statement: psycopg's own setting
        try:
            cursor = psycopg.RawCursor(conn)
            cursor.execute(sql, self._effect_params(response, params))
            held = _held(cursor.fetchone())
        except psycopg.Error as err:
            if not (_not_held(err) or _moved(err)):
                raise
            # Nothing committed; the row read on its own, autocommitted too.
            lost = self._failed(err, self._raw(conn, "row", [self.key]).fetchone())
            if lost is None:
                raise
            return lost
        finally:
            if switched:
                with contextlib.suppress(psycopg.Error):  # a broken connection stays as it is
                    conn.autocommit = False
        if not held:
            raise PostgresError(_EFFECT_UNFAILED)
        return Committed()

    def hold(self, conn: psycopg.Connection[Any]) -> Held | Lost:
        """Confirms in the caller's transaction that the key is still this
        holder's and renews its lease; it stays held until the transaction ends.
        ``conn`` must be in a transaction (see ``_in_transaction``)."""
        self._in_transaction(conn)
        try:
            held = self._write(conn, "renew", self._renew_params())
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        if isinstance(held, Held):
            # A phase may commit effects: from here the middleware no longer
            # releases the claim (a retry waits for its lease).
            self._set("claimed")
        return held

    def release(self, source: psycopg_pool.ConnectionPool[Any] | psycopg.Connection[Any]) -> None:
        """Gives up a durable claim that will not be committed."""
        try:
            if isinstance(source, psycopg_pool.ConnectionPool):
                with source.connection() as conn, conn.transaction():
                    self._raw(conn, "release", [self.key, self.token])
            else:
                with source.transaction():
                    self._raw(source, "release", [self.key, self.token])
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        self._set("claimed")


class AsyncFence(_Base):
    """The asyncio twin of ``Fence`` (psycopg ``AsyncConnection`` and
    ``AsyncConnectionPool``). The middleware hands one to every request it
    runs (``scope["idem"].fence``)."""

    async def _raw(self, conn: psycopg.AsyncConnection[Any], name: str, params: list[Any]) -> Any:
        cursor = psycopg.AsyncRawCursor(conn)
        await cursor.execute(_SQL[name], params)
        return cursor

    async def _settle(self, conn: psycopg.AsyncConnection[Any], free: bool, claimed: bool) -> Claim:
        if claimed:
            return Proceed()
        if not free:
            return _in_flight()
        row = await (await self._raw(conn, "row", [self.key])).fetchone()
        return decide(_row(self.key, row), self.fingerprint_hex, self.token)

    async def _claim_on(
        self, conn: psycopg.AsyncConnection[Any], sync: str | None, idle: str | None
    ) -> Claim:
        if self.layout == "unpartitioned":
            cursor = await self._raw(conn, "claim", self._claim_params(sync, idle))
            free, claimed = await cursor.fetchone()
            return await self._settle(conn, free, claimed)
        gate = await self._raw(conn, "partitioned_gate", [self.key, sync, idle])
        free, isolation, *_ = await gate.fetchone()
        if isolation != _PARTITIONED_ISOLATION:
            raise PostgresError(
                f"the partitioned fence needs a READ COMMITTED transaction, not {isolation}"
            )
        if not free:
            return _in_flight()
        cursor = await self._raw(conn, "partitioned_claim", self._claim_params(sync, idle)[:5])
        (claimed,) = await cursor.fetchone()
        return await self._settle(conn, True, claimed)

    async def claim(
        self, source: psycopg_pool.AsyncConnectionPool[Any] | psycopg.AsyncConnection[Any]
    ) -> Claim:
        """See ``Fence.claim``; with the middleware's ``claim_up_front`` the
        first call answers ``Proceed()`` at once (the middleware claimed)."""
        if self._taken_up_front():
            return Proceed()
        pool = source if isinstance(source, psycopg_pool.AsyncConnectionPool) else None
        try:
            if pool is not None:
                async with pool.connection() as conn:
                    claim = await self._durably(conn)
            else:
                assert isinstance(source, psycopg.AsyncConnection)
                claim = await self._durably(source)
        except psycopg.Error as err:
            raise _claim_error(err) from err
        return self._after_claim(claim, pool)

    async def _durably(self, conn: psycopg.AsyncConnection[Any]) -> Claim:
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            raise PostgresError("a durable claim needs a connection outside any transaction")
        if self.layout == "unpartitioned":
            if conn.autocommit:
                return await self._claim_on(conn, "off", None)
            async with conn.transaction():
                return await self._claim_on(conn, "off", None)
        async with conn.transaction():  # as in ``Fence._durably``
            await self._raw(conn, "read_committed", [])
            return await self._claim_on(conn, "off", _ms(self.idle_timeout))

    async def claim_in(self, conn: psycopg.AsyncConnection[Any]) -> Claim:
        """See ``Fence.claim_in``."""
        if self._taken_up_front():
            return Proceed()
        self._in_transaction(conn)
        try:
            claim = await self._claim_on(conn, None, _ms(self.idle_timeout))
        except psycopg.Error as err:
            raise _claim_error(err) from err
        return self._after_claim(claim)

    async def _write(
        self, conn: psycopg.AsyncConnection[Any], name: str, params: list[Any]
    ) -> Held | Lost:
        """See ``Fence._write``."""
        if _held(await (await self._raw(conn, name, params)).fetchone()):
            return Held()
        return self._decided(await (await self._raw(conn, "row", [self.key])).fetchone())

    async def complete(
        self, conn: psycopg.AsyncConnection[Any], response: StoredResponse
    ) -> Committed | Lost:
        """See ``Fence.complete``."""
        self._in_transaction(conn)
        try:
            written = await self._write(conn, "complete", self._complete_params(response, False))
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return Committed() if isinstance(written, Held) else written

    async def commit(
        self, conn: psycopg.AsyncConnection[Any], response: StoredResponse
    ) -> Committed | Lost:
        """See ``Fence.commit``."""
        self._committable(conn)
        self._in_transaction(conn)
        try:
            if _pipelined():
                result = await self._commit_pipelined(conn, response)
            else:
                result = await self._commit_sequential(conn, response)
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return self._reported(result, response)

    async def _commit_pipelined(
        self, conn: psycopg.AsyncConnection[Any], response: StoredResponse
    ) -> Committed | Lost:
        """See ``Fence._commit_pipelined``."""
        try:
            async with conn.pipeline():
                params = self._complete_params(response, True)
                completion = await self._raw(conn, "complete", params)
                await psycopg.AsyncRawCursor(conn).execute("COMMIT", prepare=False)
        except BaseException as err:
            with contextlib.suppress(psycopg.Error):
                await conn.rollback()
            if not (_not_held(err) or _moved(err)):
                raise
            row = await (await self._raw(conn, "row", [self.key])).fetchone()
            await conn.rollback()
            lost = self._failed(err, row)
            if lost is None:
                raise
            return lost
        if not _held(await completion.fetchone()):
            raise PostgresError(_UNFAILED)
        return Committed()

    async def _commit_sequential(
        self, conn: psycopg.AsyncConnection[Any], response: StoredResponse
    ) -> Committed | Lost:
        """See ``Fence._commit_sequential``."""
        try:
            result = await self._write(conn, "complete", self._complete_params(response, False))
            if isinstance(result, Lost):
                await conn.rollback()
                return result
            await conn.commit()
        except BaseException as err:
            with contextlib.suppress(psycopg.Error):
                await conn.rollback()
            if not _moved(err):
                raise
            row = await (await self._raw(conn, "row", [self.key])).fetchone()
            await conn.rollback()
            lost = self._failed(err, row)
            if lost is None:
                raise
            return lost
        return Committed()

    async def commit_effect(
        self,
        source: psycopg_pool.AsyncConnectionPool[Any] | psycopg.AsyncConnection[Any],
        response: StoredResponse,
        effect: str,
        params: Sequence[Any] = (),
    ) -> Committed | Lost:
        """See ``Fence.commit_effect``."""
        sql = _effect_statement(effect)
        try:
            if isinstance(source, psycopg_pool.AsyncConnectionPool):
                async with source.connection() as conn:
                    result = await self._commit_effect_on(conn, sql, response, params)
            else:
                result = await self._commit_effect_on(source, sql, response, params)
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return self._reported(result, response)

    async def _commit_effect_on(
        self,
        conn: psycopg.AsyncConnection[Any],
        sql: str,
        response: StoredResponse,
        params: Sequence[Any],
    ) -> Committed | Lost:
        """See ``Fence._commit_effect_on``."""
        self._autocommittable(conn)
        switched = not conn.autocommit
        if switched:
            await conn.set_autocommit(True)
        try:
            cursor = psycopg.AsyncRawCursor(conn)
            await cursor.execute(sql, self._effect_params(response, params))
            held = _held(await cursor.fetchone())
        except psycopg.Error as err:
            if not (_not_held(err) or _moved(err)):
                raise
            row = await (await self._raw(conn, "row", [self.key])).fetchone()
            lost = self._failed(err, row)
            if lost is None:
                raise
            return lost
        finally:
            if switched:
                with contextlib.suppress(psycopg.Error):
                    await conn.set_autocommit(False)
        if not held:
            raise PostgresError(_EFFECT_UNFAILED)
        return Committed()

    async def hold(self, conn: psycopg.AsyncConnection[Any]) -> Held | Lost:
        """See ``Fence.hold``."""
        self._in_transaction(conn)
        try:
            held = await self._write(conn, "renew", self._renew_params())
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        if isinstance(held, Held):
            self._set("claimed")  # as in ``Fence.hold``
        return held

    async def release(
        self, source: psycopg_pool.AsyncConnectionPool[Any] | psycopg.AsyncConnection[Any]
    ) -> None:
        """See ``Fence.release``."""
        try:
            if isinstance(source, psycopg_pool.AsyncConnectionPool):
                async with source.connection() as conn, conn.transaction():
                    await self._raw(conn, "release", [self.key, self.token])
            else:
                async with source.transaction():
                    await self._raw(source, "release", [self.key, self.token])
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        self._set("claimed")
