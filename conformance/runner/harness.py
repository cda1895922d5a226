"""The processes one scenario runs against, all its own and torn down
whatever happens: a redis-server with the idem module on a free port, a
Postgres database (created, migrated by ``idem-writer migrate``, dropped),
``idem-writer run`` mirroring the one into the other, and one or more
instances of an example app started through its driver (``apps.json``).
Ports, redis-server and databases come from the Python package's harness,
``idem.testing``, the one its own tests use."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis
from idem import testing
from idem.testing import HarnessError, RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]
CONFORMANCE = REPO / "conformance"
ADMIN_URL = testing.admin_url()
APP_START_TIMEOUT = float(os.environ.get("CONFORMANCE_APP_START_S", "120"))
BACKENDS = ("module", "functions")
"""What Redis runs idem as: the module, or the Functions library
(functions/idem.lua) on a Redis started as a managed service runs it (no
module, MODULE renamed away), the apps started with ``BACKEND=functions``
and the writer with ``--backend functions``."""


def writer_binary() -> Path:
    path = Path(os.environ.get("IDEM_WRITER", REPO / "target/release/idem-writer"))
    if not path.exists():
        raise HarnessError(f"{path} is missing: cargo build --release -p idem-writer")
    return path


@dataclass
class Process:
    """A child in a session of its own (signals reach what it started too),
    its output in a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""


@dataclass
class App:
    """One example app: its driver and the settings every instance gets."""

    name: str
    command: list[str]
    env: dict[str, str]

    @staticmethod
    def load(name: str) -> App:
        spec = json.loads((CONFORMANCE / "apps.json").read_text())["apps"][name]
        return App(name, list(spec["command"]), dict(spec.get("env", {})))

    @staticmethod
    def names() -> list[str]:
        return list(json.loads((CONFORMANCE / "apps.json").read_text())["apps"])

    def missing(self) -> str | None:
        """Why the app cannot run here, if it cannot."""
        program = REPO / self.command[0]
        if not program.exists():
            return f"{self.command[0]} does not exist"
        return None


@dataclass
class Stack:
    """Redis, Postgres, the writer and the app's instances of one scenario run."""

    app: App
    app_env: Mapping[str, str]
    instances: int = 1
    backend: str = "module"
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="idem-conf-")))
    redis_server: RedisServer | None = None
    db_name: str = ""
    writer: Process | None = None
    apps: list[Process] = field(default_factory=list)
    bases: list[str] = field(default_factory=list)

    @property
    def redis_port(self) -> int:
        assert self.redis_server is not None
        return self.redis_server.port

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/"

    @property
    def database_url(self) -> str:
        return testing.database_url(self.db_name)

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> Stack:
        try:
            if self.backend not in BACKENDS:
                raise HarnessError(f"backend {self.backend!r}: one of {BACKENDS}")
            self.redis_server = RedisServer(free_port(), self.dir, module=self.backend == "module")
            self.start_redis()
            self.create_database()
            self.start_writer()
            for _ in range(self.instances):
                self.start_app()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self.apps:
            proc.kill()
        if self.writer is not None:
            self.writer.kill()
        if self.redis_server is not None:
            self.redis_server.stop()
        if self.db_name:
            testing.drop_database(self.db_name)
            self.db_name = ""
        shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self) -> str:
        parts = [f"--- {p.name} log ---\n{p.log()}" for p in [*self.apps]]
        if self.writer is not None:
            parts.append(f"--- writer log ---\n{self.writer.log()}")
        if self.redis_server is not None:
            parts.append(f"--- redis log ---\n{self.redis_server.log()}")
        return "\n".join(parts)

    # ------------------------------------------------------------ Redis

    def start_redis(self) -> None:
        """Starts the scenario's server (again, after ``kill_redis``: the
        same port, empty)."""
        assert self.redis_server is not None
        self.redis_server.start()

    def kill_redis(self) -> None:
        if self.redis_server is not None:
            self.redis_server.stop()

    def redis(self) -> redis.Redis:
        assert self.redis_server is not None
        return self.redis_server.raw()

    def mirror_pending(self) -> int:
        """Completed records waiting for the writer: INFO idem's
        ``idem_mirror_pending`` on the module; on the library, the members of
        every slot's outbox (spec/outbox_slots.json; a member claimed by the
        writer stays until it is acknowledged)."""
        conn = self.redis()
        if self.backend == "module":
            return int(conn.info("idem").get("idem_mirror_pending", 1))
        outboxes = list(conn.scan_iter(match="idem:outbox:{*}", count=1000))
        return sum(int(conn.zcard(key)) for key in outboxes)

    # ------------------------------------------------------------ Postgres

    def create_database(self) -> None:
        self.db_name = testing.create_database("idem_conf_")
        migrate = subprocess.run(
            [str(writer_binary()), "migrate", "--database-url", self.database_url],
            capture_output=True,
            text=True,
            check=False,
            env={k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")},
        )
        if migrate.returncode != 0:
            raise HarnessError(f"idem-writer migrate failed:\n{migrate.stderr}")

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            return list(conn.execute(sql.encode(), params).fetchall())

    # ------------------------------------------------------------ the writer

    def start_writer(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env["RUST_LOG"] = "warn"
        argv = [
            str(writer_binary()), "run", "--redis", self.redis_url,
            "--database-url", self.database_url,
            "--block-ms", "100", "--claim-ms", "2000", "--no-cleanup",
            "--backend", self.backend,
        ]  # fmt: skip
        if self.backend == "functions":
            argv += ["--sweep-interval", "100ms"]
        self.writer = Process("writer", argv, env, self.dir / "writer.log")
        self.writer.start()

    # ------------------------------------------------------------ the app

    def start_app(self, index: int | None = None) -> None:
        """Starts instance ``index`` (a new one when None) on a port of its
        own; returns once it answers HTTP (404 for payment 0)."""
        port = free_port()
        env = {**os.environ, **self.app.env}
        env.update(
            REDIS_URL=self.redis_url,
            DATABASE_URL=self.database_url,
            PORT=str(port),
            PG_POOL_SIZE="24",
            BACKEND=self.backend,
        )
        env.update(self.app_env)
        n = len(self.apps) if index is None else index
        proc = Process(f"{self.app.name}[{n}]", self.app.command, env, self.dir / f"app{n}.log")
        proc.start()
        base = f"http://127.0.0.1:{port}"
        if index is None:
            self.apps.append(proc)
            self.bases.append(base)
        else:
            self.apps[index] = proc
            self.bases[index] = base
        deadline = time.monotonic() + APP_START_TIMEOUT
        while True:
            if not proc.alive():
                raise HarnessError(f"{proc.name} exited:\n{proc.log()}")
            try:
                auth = {"authorization": "Bearer tok_demo"}  # the apps' demo API_TOKENS
                reply = httpx.get(f"{base}/payments/0", headers=auth, timeout=2)
                if reply.status_code != 404:
                    raise HarnessError(f"{proc.name}: GET /payments/0 answered {reply.status_code}")
                return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise HarnessError(f"{proc.name} did not come up:\n{proc.log()}")
            time.sleep(0.05)


def start_app_with_env(app: App, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """Runs the app's driver with ``env`` and no database or Redis reachable
    need: for settings it must refuse before starting (exits non-zero)."""
    full = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    full.update(app.env)
    full.update(env)
    return subprocess.run(
        app.command, cwd=REPO, env=full, capture_output=True, text=True, timeout=120, check=False
    )
