"""The payment processor the API calls, simulated as in
``examples/payments-api/src/processor.rs``: it takes ``PROCESSOR_DELAY_MS``
to answer and honours an ``Idempotency-Key`` as Stripe's and Adyen's APIs
do (a second call with the same key returns the first call's charge and
charges nothing). Its ledger, ``processor_charges``, stands for the
processor's own records: tests count charges there."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

CREATE_CHARGES = """CREATE TABLE IF NOT EXISTS processor_charges (
    id              BIGSERIAL   PRIMARY KEY,
    idempotency_key TEXT        NOT NULL UNIQUE,
    amount          BIGINT      NOT NULL,
    currency        TEXT        NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
)"""

CHARGE = (
    "INSERT INTO processor_charges (idempotency_key, amount, currency) "
    "VALUES (%s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING RETURNING id"
)
"""Records the charge under the key unless it has one (no row then)."""

EXISTING = "SELECT id FROM processor_charges WHERE idempotency_key = %s"
"""The key's charge, read in a statement of its own: one a concurrent call
committed while ``CHARGE`` waited on it is not in ``CHARGE``'s snapshot."""

_next = itertools.count()


class Processor:
    """The simulated processor: its ledger's pool and its latency (seconds)."""

    def __init__(self, ledger: AsyncConnectionPool[psycopg.AsyncConnection[Any]], delay: float):
        self.ledger = ledger
        self.delay = delay

    async def charge(self, idempotency_key: str | None, amount: int, currency: str) -> int:
        """Charges ``amount`` under ``idempotency_key`` (a fresh key when None:
        every such call charges) and answers the charge id after the latency.
        The ledger's connection is held for its statements only, never across
        the latency."""
        key = idempotency_key if idempotency_key is not None else _fresh_key()
        # One short READ COMMITTED transaction (the pool commits it on exit);
        # each statement reads its own snapshot.
        async with self.ledger.connection() as conn:
            row = await (await conn.execute(CHARGE, (key, amount, currency))).fetchone()
            if row is None:
                row = await (await conn.execute(EXISTING, (key,))).fetchone()
        if row is None:
            raise RuntimeError(f"no charge under {key!r}")
        if self.delay > 0:
            await asyncio.sleep(self.delay)
        return int(row[0])


def _fresh_key() -> str:
    """A key no other call uses: this process, the clock and a counter."""
    return f"anon-{os.getpid()}-{time.time_ns()}-{next(_next)}"
