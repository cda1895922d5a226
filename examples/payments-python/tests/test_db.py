"""The fenced payment's Postgres side on a throwaway database ($DATABASE_URL's
server, else 127.0.0.1:5432): ids reserved ahead, unique with the table's
other writers and reserved by one task at a time; the application's
``created_at`` formatted as Postgres formats it; the row written by the
fence's ``commit_effect`` read back with the same bytes as the response."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from idem.fence import AsyncFence, Committed, Proceed
from psycopg_pool import AsyncConnectionPool

from payments_app import db
from payments_app.payments import created

REPO = Path(__file__).resolve().parents[3]
ADMIN_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def database_url() -> Iterator[str]:
    """A database of its own with the writer's ``idempotency_keys`` and the
    app's ``payments``, dropped at the end."""
    name = f"payments_py_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = f"{ADMIN_URL.rpartition('/')[0]}/{name}"
    try:
        migrations = sorted((REPO / "crates/idem-writer/migrations").glob("*.sql"))
        with psycopg.connect(url, autocommit=True) as conn:
            for migration in migrations:
                if "partitioned" not in migration.name:
                    conn.execute(migration.read_text())
            conn.execute(db.CREATE_PAYMENTS)
        yield url
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _pool(url: str) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
    return AsyncConnectionPool(url, min_size=1, max_size=4, open=False)


@pytest.mark.asyncio
async def test_reserved_ids_are_unique_and_reserved_by_one_task_at_a_time(
    database_url: str,
) -> None:
    async with _pool(database_url) as pool:
        ids = db.PaymentIds()
        taken = await asyncio.gather(*(ids.next(pool) for _ in range(100)))
        # Another writer of the table (the unfenced path) gets an id of its own.
        other = await db.insert_payment(pool, 1, "EUR", "bob")
        async with pool.connection() as conn:
            cursor = await conn.execute("SELECT last_value FROM payments_id_seq")
            row = await cursor.fetchone()
    assert len(set(taken)) == 100
    assert other.id not in taken
    # 100 ids at 64 a round trip: two reservations, made one after the other.
    assert row is not None
    assert row[0] == 2 * db.RESERVED_IDS + 1 == other.id
    assert sorted(taken) == list(range(1, 101))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "at",
    [
        datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc),
        datetime(2026, 12, 31, 23, 59, 59, 0, tzinfo=timezone.utc),
        datetime(2026, 6, 1, 1, 2, 3, 40, tzinfo=timezone(timedelta(hours=-7))),
    ],
)
async def test_created_at_is_formatted_as_postgres_formats_it(
    database_url: str, at: datetime
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        query = f"SELECT {db.CREATED_AT} FROM (SELECT %s::timestamptz AS created_at) AS t"
        row = await (await conn.execute(query, (at,))).fetchone()
    assert row is not None
    assert db.rfc3339_micros(at) == row[0]


@pytest.mark.asyncio
async def test_the_fenced_insert_reads_back_as_its_response(database_url: str) -> None:
    async with _pool(database_url) as pool:
        fence = AsyncFence(f"idem:{{t:{uuid.uuid4().hex}}}", 7, b"fp", 60)
        assert await fence.claim(pool) == Proceed()
        id_ = await db.PaymentIds().next(pool)
        payment, at = db.new_payment(id_, 1000, "EUR", "acct_bob")
        row = [payment.id, payment.amount, payment.currency, payment.recipient, at]
        assert await fence.commit_effect(pool, created(payment), db.INSERT_FENCED, row) == (
            Committed()
        )
        # GET /payments/{id} answers the bytes the POST answered.
        assert await db.find_payment(pool, id_) == payment
    assert payment.created_at.endswith("Z")
    assert len(payment.created_at) == 27


@pytest.fixture
def empty_database_url() -> Iterator[str]:
    """A database of its own with nothing in it, dropped at the end."""
    name = f"payments_py_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{ADMIN_URL.rpartition('/')[0]}/{name}"
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.asyncio
async def test_the_app_creates_the_writers_schema_without_the_writer(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No idem-writer anywhere: the app applies the writer's migrations over
    # its own connection, recorded as the writer records them.
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("IDEM_WRITER", "/nonexistent/idem-writer")
    async with _pool(empty_database_url) as pool:
        await asyncio.gather(db.migrate(pool), db.migrate(pool))  # concurrently, once
        await db.migrate(pool)
        async with pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT version, name FROM idem_writer_migrations ORDER BY version"
            )
            applied = await cursor.fetchall()
            cursor = await conn.execute(
                "SELECT column_name FROM information_schema.columns"
                " WHERE table_name = 'idempotency_keys' ORDER BY column_name"
            )
            columns = {row[0] for row in await cursor.fetchall()}
    assert applied == [(v, n) for v, n, _ in db.writer_migrations()]
    assert applied[:3] == [(1, "idempotency_keys"), (2, "fenced"), (3, "lease")]  # migrate.rs
    assert {"key", "fingerprint", "token", "lease_expires_at", "response_body"} <= columns
