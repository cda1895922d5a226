"""The test harness of idem's Python code: free ports (never 6379 or 6390),
redis-server with a private copy of the module (or as a managed service runs
it: no module, ``MODULE`` renamed away), and throwaway Postgres databases,
all torn down by their owner whatever happens.

One harness for the package's tests (through the pytest plugin
``idem.testing.plugin``), the conformance runner (conformance/runner) and
the peer benchmark (bench/python-peers). Not part of the client's API: it
starts processes, and needs ``redis-server`` and a Postgres that trusts
``$DATABASE_URL``'s user.

Settings from the environment: ``IDEM_MODULE`` (the module to load),
``IDEM_REDIS_SERVER`` (the redis-server binary), ``DATABASE_URL`` (an admin
connection to the Postgres the databases are made in; the local one on
127.0.0.1:5432 by default)."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import redis

RESERVED_PORTS = frozenset({6379, 6390})
"""Ports the harness never takes (other servers on the machine)."""


class HarnessError(RuntimeError):
    """A process did not come up (with its log), or something it needs is missing."""


def free_port() -> int:
    """A port below the kernel's ephemeral range nobody listens on (never
    one of ``RESERVED_PORTS``)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        low = 32768
    for _ in range(500):
        port = random.randrange(10000, max(low, 11000))
        if port in RESERVED_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise HarnessError("no free port")


_MODULE_COPY: list[Path] = []


def module_path(candidates: Sequence[Path] = ()) -> Path:
    """A private copy of the module, made once per process: a build that
    rewrites the shared file in place (``cp`` onto it) crashes every
    redis-server that has it loaded. The module is ``$IDEM_MODULE``, else
    the newest of ``candidates`` that exists."""
    if _MODULE_COPY:
        return _MODULE_COPY[0]
    if env := os.environ.get("IDEM_MODULE"):
        built = Path(env)
    else:
        found = [p for p in candidates if p.exists()]
        if not found:
            raise HarnessError("libidem.so not built: set IDEM_MODULE")
        built = max(found, key=lambda p: p.stat().st_mtime)
    directory = Path(tempfile.mkdtemp(prefix="idem-module-"))
    atexit.register(shutil.rmtree, directory, True)
    copy = directory / "libidem.so"
    shutil.copy2(built, copy)  # with its execute bit: Redis refuses a module without
    _MODULE_COPY.append(copy)
    return copy


def redis_server_binary() -> str:
    return os.environ.get("IDEM_REDIS_SERVER", "redis-server")


@dataclass
class RedisServer:
    """A redis-server on ``port`` keeping its files (and ``redis.log``) in
    ``dir``, in a session of its own. ``start`` again after ``stop``
    restarts it on the same port, empty."""

    port: int
    dir: Path
    module: bool = True
    """With the module; else as a managed service runs it: none, and
    ``MODULE`` renamed away (plus ``renamed``)."""
    renamed: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    """More of redis-server's options (``--enable-debug-command yes``)."""
    module_candidates: Sequence[Path] = ()
    """Where to look for the module when ``$IDEM_MODULE`` is not set."""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/"

    def start(self, *module_args: str, timeout: float = 20) -> None:
        """Starts it (the module with ``module_args``); returns once it
        answers PING, else raises ``HarnessError`` with its log."""
        config = self.dir / "redis.conf"
        config.write_text(
            "".join(f'rename-command {name} ""\n' for name in ("MODULE", *self.renamed))
            if not self.module
            else ""
        )
        load = (
            ["--loadmodule", str(module_path(self.module_candidates)), *module_args]
            if self.module
            else []
        )
        self.proc = subprocess.Popen(
            [
                redis_server_binary(), str(config),
                "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                "--logfile", str(self.dir / "redis.log"),
                *self.extra_args,
                *load,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise HarnessError(f"redis-server exited:\n{self.log()}")
            try:
                if self.raw(socket_timeout=1).ping():
                    return
            except redis.RedisError:
                time.sleep(0.02)
        raise HarnessError(f"redis-server not ready:\n{self.log()}")

    def stop(self) -> None:
        """Kills it (thawed first, should it be stopped) and waits for it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def raw(self, socket_timeout: float = 5) -> redis.Redis:
        """A plain redis-py client of the server."""
        return redis.Redis(port=self.port, socket_timeout=socket_timeout)


def start_redis(
    *module_args: str,
    module: bool = True,
    renamed: tuple[str, ...] = (),
    extra_args: tuple[str, ...] = (),
    module_candidates: Sequence[Path] = (),
) -> RedisServer:
    """A started server on a free port, in a directory of its own (removed
    by ``stop_redis``)."""
    server = RedisServer(
        free_port(),
        Path(tempfile.mkdtemp(prefix="idem-redis-")),
        module=module,
        renamed=renamed,
        extra_args=extra_args,
        module_candidates=module_candidates,
    )
    try:
        server.start(*module_args)
    except BaseException:
        stop_redis(server)
        raise
    return server


def stop_redis(server: RedisServer) -> None:
    """Stops a server of ``start_redis`` and removes its directory."""
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_server(
    *module_args: str,
    module: bool = True,
    renamed: tuple[str, ...] = (),
    extra_args: tuple[str, ...] = (),
    module_candidates: Sequence[Path] = (),
) -> Iterator[RedisServer]:
    """``start_redis`` for the block's length."""
    server = start_redis(
        *module_args,
        module=module,
        renamed=renamed,
        extra_args=extra_args,
        module_candidates=module_candidates,
    )
    try:
        yield server
    finally:
        stop_redis(server)


# ---------------------------------------------------------------- Postgres


def admin_url() -> str:
    """The admin connection databases are made with: ``$DATABASE_URL``,
    else the local Postgres."""
    return os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def database_url(name: str) -> str:
    """The URL of database ``name`` on the admin connection's server."""
    base, _, _ = admin_url().rpartition("/")
    return f"{base}/{name}"


def create_database(prefix: str = "idem_test_") -> str:
    """A new, empty database (a name of ``prefix`` and a random part): its name."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url(), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"'.encode())
    return name


def drop_database(name: str) -> None:
    """Drops ``name``, its sessions ended first (``WITH (FORCE)``)."""
    with psycopg.connect(admin_url(), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())


@contextlib.contextmanager
def database(
    prefix: str = "idem_test_", setup: Callable[[str], None] | None = None
) -> Iterator[str]:
    """A database of its own for the block, ``setup`` run on its URL first,
    dropped at the end whatever happens: its URL."""
    name = create_database(prefix)
    try:
        url = database_url(name)
        if setup is not None:
            setup(url)
        yield url
    finally:
        drop_database(name)


def run_sql_files(url: str, files: Sequence[Path]) -> None:
    """Runs each file's statements on ``url``, in order, autocommitted."""
    with psycopg.connect(url, autocommit=True) as conn:
        for path in files:
            conn.execute(path.read_bytes())
