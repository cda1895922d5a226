"""The example's Postgres side, as ``examples/payments-api/src/db.rs``: the
connection pool, its own migration (``payments``, and the processor's
``processor_charges``) and its queries. ``idempotency_keys`` is the writer's:
when it is missing, the app applies the writer's migrations itself, as
``idem-writer migrate`` applies them to a fresh database (as the Rust example
calls ``idem_writer::migrate``), over its own connection: no Rust binary,
and the same ``DATABASE_URL`` (TLS settings included) as every query."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from payments_app import processor

MIGRATION_LOCK_ID = 0x7061_796D_656E_7473
"""Transaction-scoped advisory lock serialising concurrent migrations (db.rs)."""

WRITER_MIGRATIONS = Path(__file__).resolve().parents[3] / "crates/idem-writer/migrations"
"""The writer's migrations, ``NNNN_name.sql`` (the ``_partitioned`` variant of
the first is for the other layout)."""
WRITER_LOCK_ID = 0x6964_656D_7772_6974
"""The writer's migration lock ("idemwrit", ``postgres/migrate.rs``): the app
and any writer starting at once migrate one after the other."""
CREATE_WRITER_MIGRATIONS = """CREATE TABLE IF NOT EXISTS idem_writer_migrations (
    version    INT         PRIMARY KEY,
    name       TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)"""

CREATE_PAYMENTS = """CREATE TABLE IF NOT EXISTS payments (
    id         BIGSERIAL   PRIMARY KEY,
    amount     BIGINT      NOT NULL CHECK (amount > 0),
    currency   TEXT        NOT NULL,
    recipient  TEXT        NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
)"""

CREATED_AT = "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
"""``created_at`` as RFC 3339 UTC with microseconds, formatted by Postgres."""

INSERT = (
    "INSERT INTO payments (amount, currency, recipient) VALUES (%s, %s, %s) "
    f"RETURNING id, amount, currency, recipient, {CREATED_AT}"
)
FIND = f"SELECT id, amount, currency, recipient, {CREATED_AT} FROM payments WHERE id = %s"

INSERT_FENCED = (
    "INSERT INTO payments (id, amount, currency, recipient, created_at) "
    "VALUES ($7, $8, $9, $10, $11)"
)
"""The fenced payment's row, its values all known beforehand (the id
reserved, the time the application's), as the effect of
``AsyncFence.commit_effect``: parameters from ``$7``, the fence's own first."""

RESERVED_IDS = 64
"""How many ids ``PaymentIds`` reserves per round trip."""
RESERVE_IDS = (
    "SELECT nextval(pg_get_serial_sequence('payments', 'id')) FROM generate_series(1, %s::int8)"
)

POOL_TIMEOUT = 5.0
"""Bound on opening a connection and on waiting for a free one (seconds)."""
TCP_USER_TIMEOUT_MS = 10_000
"""Bound on unacknowledged bytes to Postgres: a lost link fails a statement
after this instead of TCP's retransmissions (about 15 minutes)."""


@dataclass(frozen=True, slots=True)
class Payment:
    id: int
    amount: int
    currency: str
    recipient: str
    created_at: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class MissingSchema(RuntimeError):
    """``idempotency_keys`` is not there: the writer's migrations have not run."""


def pool(database_url: str, max_size: int) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
    """A pool of up to ``max_size`` connections to ``database_url`` (not open yet)."""
    return AsyncConnectionPool(
        database_url,
        min_size=1,
        max_size=max_size,
        timeout=POOL_TIMEOUT,
        kwargs={"connect_timeout": int(POOL_TIMEOUT), "tcp_user_timeout": TCP_USER_TIMEOUT_MS},
        open=False,
    )


def writer_migrations(directory: Path = WRITER_MIGRATIONS) -> list[tuple[int, str, str]]:
    """The writer's migrations for the unpartitioned layout (what a fresh
    database gets), in order: (version, name, SQL)."""
    files = sorted(
        path
        for path in directory.glob("[0-9][0-9][0-9][0-9]_*.sql")
        if not path.stem.endswith("_partitioned")
    )
    return [(int(path.name[:4]), path.stem[5:], path.read_text()) for path in files]


async def migrate_writer(pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]]) -> None:
    """The writer's migrations not yet applied, in one transaction under the
    writer's lock, recorded in its ``idem_writer_migrations`` as
    ``idem-writer migrate`` records them (a writer started later finds them
    applied)."""
    migrations = writer_migrations()
    if not migrations:
        raise MissingSchema(
            f"idempotency_keys is missing and the writer's migrations are not in "
            f"{WRITER_MIGRATIONS}: run `idem-writer migrate --database-url ...`"
        )
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK_ID,))
        await conn.execute(CREATE_WRITER_MIGRATIONS)
        cursor = await conn.execute("SELECT version FROM idem_writer_migrations")
        applied = {int(row[0]) for row in await cursor.fetchall()}
        for version, name, sql in migrations:
            if version in applied:
                continue
            await conn.execute(sql)
            await conn.execute(
                "INSERT INTO idem_writer_migrations (version, name) VALUES (%s, %s)",
                (version, name),
            )


async def migrate(pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]]) -> None:
    """Creates the writer's ``idempotency_keys`` (its migrations, see
    ``migrate_writer``), ``payments`` and ``processor_charges`` when
    missing; safe to run concurrently."""
    async with pool.connection() as conn:
        cursor = await conn.execute("SELECT to_regclass('idempotency_keys') IS NOT NULL")
        row = await cursor.fetchone()
    if row is None or not row[0]:
        await migrate_writer(pool)
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_ID,))
        await conn.execute(CREATE_PAYMENTS)
        await conn.execute(processor.CREATE_CHARGES)


def _payment(row: tuple[Any, ...] | None) -> Payment:
    if row is None:
        raise RuntimeError("the insert answered no row")
    return Payment(int(row[0]), int(row[1]), str(row[2]), str(row[3]), str(row[4]))


async def insert_payment(
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]],
    amount: int,
    currency: str,
    recipient: str,
) -> Payment:
    """Inserts a payment in its own transaction."""
    async with pool.connection() as conn:
        return await insert_payment_in(conn, amount, currency, recipient)


async def insert_payment_in(
    conn: psycopg.AsyncConnection[Any], amount: int, currency: str, recipient: str
) -> Payment:
    """Inserts a payment in ``conn``'s transaction."""
    cursor = await conn.execute(INSERT, (amount, currency, recipient))
    return _payment(await cursor.fetchone())


class PaymentIds:
    """Payment ids reserved ahead from the table's own sequence,
    ``RESERVED_IDS`` per round trip, so a fenced payment's response (its id)
    is known before its row is written (db.rs ``PaymentIds``). Ids are unique
    with every other writer of the table (each is a ``nextval``); ids
    reserved by a process that stops are never used (gaps, as a rolled-back
    insert leaves)."""

    def __init__(self) -> None:
        self._ready: deque[int] = deque()
        # Held by the one task reserving more; the others wait for it.
        self._reserving = asyncio.Lock()

    async def next(self, pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]]) -> int:
        """The next reserved id, reserving more when none is left."""
        while True:
            if self._ready:
                return self._ready.popleft()
            async with self._reserving:
                if self._ready:
                    continue  # reserved by the task this one waited for
                async with pool.connection() as conn:
                    cursor = await conn.execute(RESERVE_IDS, (RESERVED_IDS,))
                    rows = await cursor.fetchall()
                self._ready.extend(int(row[0]) for row in rows)


def new_payment(id_: int, amount: int, currency: str, recipient: str) -> tuple[Payment, datetime]:
    """A fenced payment's row and response, before it is written:
    ``created_at`` is now on the application's clock (microseconds, as
    Postgres keeps it), formatted as ``CREATED_AT`` formats it."""
    at = datetime.now(timezone.utc)
    return Payment(id_, amount, currency, recipient, rfc3339_micros(at)), at


def rfc3339_micros(at: datetime) -> str:
    """``at`` as Postgres' ``CREATED_AT`` formats it: RFC 3339 UTC, six
    fractional digits, ``Z``."""
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def find_payment(
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]], id_: int
) -> Payment | None:
    async with pool.connection() as conn:
        cursor = await conn.execute(FIND, (id_,))
        row = await cursor.fetchone()
    return None if row is None else _payment(row)
