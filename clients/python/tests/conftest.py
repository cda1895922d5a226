"""Fixtures: a redis-server with the idem module on a free port (never 6379
or 6390), a "managed" one (no module, ``MODULE`` renamed away: the client
loads the Functions library), both from the harness's pytest plugin
(``idem.testing.plugin``), and throwaway Postgres databases with the
writer's migrations (``idem.testing.database``), dropped at the end whatever
happens.

``client`` and ``aclient`` (and what uses them) run once per backend in
``$IDEM_TEST_BACKENDS`` (module, functions, scripts by default): the module
on the module's server, the library's functions and its scripts form on the
managed one."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, Self, cast

import psycopg
import pytest

import idem
import idem.asyncio
from idem import testing
from idem.fence import Fence, Proceed
from idem.testing import RedisServer, free_port

REPO = Path(__file__).resolve().parents[3]
BACKENDS = tuple(
    b for b in os.environ.get("IDEM_TEST_BACKENDS", "module,functions,scripts").split(",") if b
)
MODULE_CANDIDATES = (
    REPO / "target/release/module/libidem.so",
    REPO / "target/release/libidem.so",
    REPO / "target/debug/libidem.so",
)
"""Where the module is looked for without ``$IDEM_MODULE`` (the newest)."""

# The servers, ports and databases: idem.testing, its fixtures from the plugin.
pytest_plugins = ["idem.testing.plugin"]


@pytest.fixture(scope="session")
def idem_module_candidates() -> Sequence[Path]:
    return MODULE_CANDIDATES


def start_redis(
    *module_args: str, module: bool = True, renamed: tuple[str, ...] = ()
) -> RedisServer:
    """``idem.testing.start_redis`` as the fixtures start theirs."""
    return testing.start_redis(
        *module_args,
        module=module,
        renamed=renamed,
        extra_args=("--enable-debug-command", "yes"),
        module_candidates=MODULE_CANDIDATES,
    )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The backend a test runs on (``$IDEM_TEST_BACKENDS``)."""
    return str(request.param)


@pytest.fixture
def target(backend: str, request: pytest.FixtureRequest) -> RedisServer:
    """The server for ``backend``: the module's, or the managed one."""
    name = "redis_server" if backend == "module" else "managed_server"
    return cast(RedisServer, request.getfixturevalue(name))


@pytest.fixture
def client(target: RedisServer, backend: str) -> Iterator[idem.IdemClient]:
    c = idem.IdemClient.from_url(target.url, backend=backend)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
async def aclient(target: RedisServer, backend: str) -> AsyncIterator[idem.asyncio.IdemClient]:
    c = idem.asyncio.IdemClient.from_url(target.url, backend=backend)
    try:
        yield c
    finally:
        await c.aclose()


def key() -> str:
    """A key no other test uses."""
    return f"idem:{{t:{uuid.uuid4().hex}}}"


# ---------------------------------------------------------------- Postgres

ADMIN_URL = testing.admin_url()
MIGRATIONS = REPO / "crates/idem-writer/migrations"


def migrations() -> list[Path]:
    """The writer's migrations for the unpartitioned layout, in order."""
    files = sorted(MIGRATIONS.glob("*.sql"))
    return [f for f in files if "partitioned" not in f.name]


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A database of its own with ``idempotency_keys``, dropped at the end."""
    with testing.database("idem_py_", lambda url: testing.run_sql_files(url, migrations())) as url:
        yield url


def _setup(url: str, layout: str, daily: bool) -> None:
    files = sorted(MIGRATIONS.glob("*.sql"))
    first = "0001_idempotency_keys_partitioned.sql" if layout == "partitioned" else None
    chosen = [f for f in files if not f.name.startswith("0001_")]
    chosen.insert(0, MIGRATIONS / (first or "0001_idempotency_keys.sql"))
    testing.run_sql_files(url, chosen)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, amount INT)"
        )
        if daily:
            # A partition per UTC day, today to today + 3, as the writer
            # makes them: a row whose expires_at changes day moves.
            for day in range(4):
                conn.execute(
                    f"CREATE TABLE idempotency_keys_d{day} PARTITION OF idempotency_keys"
                    f" FOR VALUES FROM (date_trunc('day', now() AT TIME ZONE 'UTC')"
                    f" AT TIME ZONE 'UTC' + interval '{day} days')"
                    f" TO (date_trunc('day', now() AT TIME ZONE 'UTC')"
                    f" AT TIME ZONE 'UTC' + interval '{day + 1} days')"
                )
        elif layout == "partitioned":
            conn.execute(
                "CREATE TABLE idempotency_keys_all PARTITION OF idempotency_keys"
                " FOR VALUES FROM (MINVALUE) TO ('9999-12-31 00:00:00+00')"
            )


def _database(layout: str, daily: bool = False) -> Iterator[str]:
    with testing.database("idem_py_", lambda url: _setup(url, layout, daily)) as url:
        yield url


@pytest.fixture(scope="session")
def fence_database_url() -> Iterator[str]:
    """A database with the writer's table and a payments table, dropped at the end."""
    yield from _database("unpartitioned")


@pytest.fixture(scope="session")
def partitioned_database_url() -> Iterator[str]:
    """The same on the partitioned layout (one catch-all partition)."""
    yield from _database("partitioned")


@pytest.fixture(scope="session")
def daily_partitioned_database_url() -> Iterator[str]:
    """The partitioned layout with a partition per day, today to today + 3."""
    yield from _database("partitioned", daily=True)


class _Proxy:
    """A TCP proxy on a free local port to ``host:port`` (the test
    Postgres), for the links the tests shape; subclasses forward."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = free_port()
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    def url(self, database_url: str) -> str:
        """``database_url`` through the proxy."""
        parts = urllib.parse.urlsplit(database_url)
        user = f"{parts.username}@" if parts.username else ""
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Closes every connection (psycopg's pending calls then fail)."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class Blackhole(_Proxy):
    """A TCP proxy to Postgres that can stop forwarding without closing
    anything (a partition that drops packets): bytes already sent wait, new
    connections are accepted and hear nothing. ``thaw`` forwards again."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.open = asyncio.Event()
        self.open.set()

    def freeze(self) -> None:
        self.open.clear()

    def thaw(self) -> None:
        self.open.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        await self.open.wait()
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.append(up_writer)
        for a, b in ((reader, up_writer), (up_reader, writer)):
            self._spawn(self._pump(a, b))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.open.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


@pytest.fixture
async def blackhole() -> AsyncIterator[Blackhole]:
    """A ``Blackhole`` in front of the test Postgres."""
    parts = urllib.parse.urlsplit(ADMIN_URL)
    async with Blackhole(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        yield proxy


class SlowLink(_Proxy):
    """A TCP proxy to Postgres that holds what the server sends for ``delay``
    seconds (in order) before passing it on: each round trip then costs
    ``delay``, so a call's duration counts its round trips."""

    def __init__(self, host: str, port: int, delay: float) -> None:
        super().__init__(host, port)
        self.delay = delay

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.append(up_writer)
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self._spawn(self._pump(reader, up_writer))
        self._spawn(self._hold(up_reader, held))
        self._spawn(self._release(held, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def _hold(self, reader: asyncio.StreamReader, held: asyncio.Queue[Any]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(65536):
                held.put_nowait((loop.time() + self.delay, data))
        except OSError:
            pass
        held.put_nowait((loop.time() + self.delay, b""))

    async def _release(self, held: asyncio.Queue[Any], writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await held.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


@pytest.fixture
async def slow_link() -> AsyncIterator[SlowLink]:
    """A ``SlowLink`` (0.2 s a round trip) in front of the test Postgres."""
    parts = urllib.parse.urlsplit(ADMIN_URL)
    async with SlowLink(parts.hostname or "127.0.0.1", parts.port or 5432, 0.2) as proxy:
        yield proxy


def waiting_for_a_lock(url: str, pid: int) -> None:
    """Waits until the session ``pid`` waits for a lock (the fence's gate)."""
    deadline = time.monotonic() + 5
    with psycopg.connect(url, autocommit=True) as other:
        while time.monotonic() < deadline:
            row = other.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row is not None and row[0] == "Lock":
                return
            time.sleep(0.02)
    raise AssertionError(f"session {pid} never waited for a lock")


def moving_takeover(url: str, k: str, token: int) -> tuple[psycopg.Connection[Any], int]:
    """A takeover of ``k`` (its lease lapsed, fingerprint ``fp``) with a
    two-day TTL, claimed with ``token`` in an open transaction on the
    connection returned: it holds the gate and has moved the row to the
    partition two days ahead, not yet committed (the partitioned layout)."""
    taker = Fence(k, token, b"fp", 2 * 86400, layout="partitioned")
    conn = psycopg.connect(url)
    assert taker.claim_in(conn) == Proceed()
    return conn, taker.token
