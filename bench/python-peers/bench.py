"""Python middleware vs AWS Lambda Powertools' idempotency utility (Redis
persistence layer) in the same FastAPI process on the same Redis (with the
idem module): throughput for new keys and replays with Redis commands and
Redis CPU per request (INFO commandstats / INFO cpu deltas), as ratios from
one run; then behaviour probes (concurrent duplicates, mismatch, a returned
500 then a retry, a holder frozen past idem's lease on one of two
instances). Run by ./run.sh; prints a Markdown report."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from idem.testing import RedisServer, free_port

HERE = Path(__file__).resolve().parent
REQUESTS = int(os.environ.get("PEERS_REQUESTS", "2000"))
CONCURRENCY = int(os.environ.get("PEERS_CONCURRENCY", "32"))
ROUNDS = int(os.environ.get("PEERS_ROUNDS", "2"))
LEASE_MS = 1000
LAYERS = {"idem": "/idem/payments", "powertools": "/pt/payments"}


@contextmanager
def processes(directory: Path) -> Iterator[tuple[int, list[tuple[subprocess.Popen[bytes], str]]]]:
    """redis-server with a private copy of the module (``idem.testing``, the
    harness of the package's tests), and two app instances."""
    server = RedisServer(free_port(), directory)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        server.start()
        redis_port = server.port
        apps = []
        for n in range(2):
            port = free_port()
            env = {
                **os.environ,
                "REDIS_URL": f"redis://127.0.0.1:{redis_port}/",
                "LEASE_MS": str(LEASE_MS),
            }
            log = (directory / f"app{n}.log").open("wb")
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "app:app",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                ],
                cwd=HERE,
                env=env,
                stdout=log,
                stderr=log,
            )
            procs.append(proc)
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda b=base: httpx.get(f"{b}/idem/none").status_code == 404)
            apps.append((proc, base))
        yield redis_port, apps
    finally:
        for proc in procs:
            with suppress(OSError):
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
        server.stop()


def wait_for(check: Any, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if check():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("not up in time")
        time.sleep(0.05)


@dataclass
class Phase:
    requests: int = 0
    seconds: float = 0
    commands: int = 0
    cpu: float = 0
    new_keys: int = 0
    non_2xx: int = 0

    def add(self, other: Phase) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def redis_counters(r: redis.Redis) -> tuple[int, float, int]:
    stats = r.info("commandstats")
    calls = sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")
    cpu = r.info("cpu")
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), int(r.dbsize())


async def load(base: str, path: str, keys: list[str]) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    sem = asyncio.Semaphore(CONCURRENCY)
    bad = 0
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as http:

        async def one(key: str) -> None:
            nonlocal bad
            async with sem:
                reply = await http.post(
                    path, json={"amount": 100}, headers={"idempotency-key": key}
                )
                if not 200 <= reply.status_code < 300:
                    bad += 1

        started = time.perf_counter()
        await asyncio.gather(*(one(k) for k in keys))
        return time.perf_counter() - started, bad


def measure(r: redis.Redis, base: str, path: str, keys: list[str]) -> Phase:
    calls0, cpu0, size0 = redis_counters(r)
    seconds, bad = asyncio.run(load(base, path, keys))
    calls1, cpu1, size1 = redis_counters(r)
    return Phase(len(keys), seconds, calls1 - calls0 - 2, cpu1 - cpu0, size1 - size0, bad)


def throughput(r: redis.Redis, base: str) -> dict[tuple[str, str], Phase]:
    totals = {(layer, kind): Phase() for layer in LAYERS for kind in ("new", "replay")}
    for round_ in range(ROUNDS):
        order = list(LAYERS) if round_ % 2 == 0 else list(reversed(LAYERS))
        for layer in order:
            keys = [f"{layer}-{round_}-{uuid.uuid4().hex}" for _ in range(REQUESTS)]
            totals[(layer, "new")].add(measure(r, base, LAYERS[layer], keys))
            totals[(layer, "replay")].add(measure(r, base, LAYERS[layer], keys))
    return totals


# ---------------------------------------------------------------- probes

PROBED = {
    "idem": "/idem/payments",
    "powertools": "/pt/payments",
    "powertools + payload validation": "/ptv/payments",
}


async def post(base: str, path: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(base + path, json=body, headers={"idempotency-key": key})
        try:
            return reply.status_code, reply.json()
        except ValueError:
            return reply.status_code, reply.text


@dataclass
class Probe:
    """The app instances and their handler-run counters."""

    apps: list[tuple[subprocess.Popen[bytes], str]]

    async def runs(self) -> int:
        async with httpx.AsyncClient(timeout=30) as http:
            counts = [(await http.get(f"{b}/runs")).json()["runs"] for _, b in self.apps]
        return int(sum(counts))

    @property
    def base(self) -> str:
        return self.apps[0][1]

    async def duplicates(self, path: str) -> str:
        key, before = uuid.uuid4().hex, await self.runs()
        answers = await asyncio.gather(
            *(post(self.base, path, key, {"amount": 1, "delay_ms": 300}) for _ in range(20))
        )
        statuses = sorted({s for s, _ in answers})
        return f"handler ran {await self.runs() - before}x; statuses {statuses}"

    async def mismatch(self, path: str) -> str:
        key = uuid.uuid4().hex
        first = await post(self.base, path, key, {"amount": 1})
        status, body = await post(self.base, path, key, {"amount": 2})
        if status == first[0] and body == first[1]:
            return f"{status}: the first request's answer, for another body"
        return f"{status}"

    async def replay(self, path: str) -> str:
        key = uuid.uuid4().hex
        first = await post(self.base, path, key, {"amount": 1})
        again = await post(self.base, path, key, {"amount": 1})
        same = "the same answer" if again == first else f"not the first answer: {again[1]}"
        return f"{first[0]} then {again[0]}, {same}"

    async def failed(self, path: str) -> str:
        key, before = uuid.uuid4().hex, await self.runs()
        first = await post(self.base, path, key, {"amount": 1, "fail": True})
        again = await post(self.base, path, key, {"amount": 1, "fail": True})
        ran = await self.runs() - before
        what = "ran the handler again" if ran == 2 else "did not run the handler"
        return f"{first[0]} then {again[0]}; the retry {what}"

    async def frozen(self, path: str) -> str:
        """The holder on instance 0 is frozen inside its handler (1.5 s) 0.3 s
        in; a client retries on instance 1 every 200 ms for up to 5 s; then
        the holder thaws."""
        (holder, a), (_, b) = self.apps
        key, before = uuid.uuid4().hex, await self.runs()
        body = {"amount": 1, "delay_ms": 1500}
        original = asyncio.ensure_future(post(a, path, key, body))
        await asyncio.sleep(0.3)
        holder.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        got: tuple[int, Any] = (0, None)
        after = None
        while time.monotonic() - started < 5:
            got = await post(b, path, key, body)
            if 200 <= got[0] < 300:
                after = time.monotonic() - started
                break
            await asyncio.sleep(0.2)
        holder.send_signal(signal.SIGCONT)
        first = await original
        final = await post(b, path, key, body)
        answers = {
            json.dumps(x[1], sort_keys=True) for x in (first, final, got) if 200 <= x[0] < 300
        }
        retry = (
            f"a retry ran after {after:.1f} s"
            if after is not None
            else f"retries still {got[0]} after 5 s"
        )
        return (
            f"{retry}; the thawed holder's client got {first[0]}; handler ran "
            f"{await self.runs() - before}x; {len(answers)} distinct 2xx answer(s) for the key"
        )


async def probes(apps: list[tuple[subprocess.Popen[bytes], str]]) -> dict[str, dict[str, str]]:
    probe = Probe(apps)
    table: dict[str, dict[str, str]] = {}
    for layer, path in PROBED.items():
        table[layer] = {
            "20 concurrent duplicates (handler 300 ms)": await probe.duplicates(path),
            "same key, another body": await probe.mismatch(path),
            "same key, same body, after completion": await probe.replay(path),
            "a returned 500, then the retry": await probe.failed(path),
            "holder frozen past idem's lease (1 s), 2 instances": await probe.frozen(path),
        }
    return table


def main() -> None:
    with (
        tempfile.TemporaryDirectory(prefix="idem-peers-") as tmp,
        processes(Path(tmp)) as (
            redis_port,
            apps,
        ),
    ):
        r = redis.Redis(port=redis_port)
        results = throughput(r, apps[0][1])
        table = asyncio.run(probes(apps))
    report(results, table)


def report(results: dict[tuple[str, str], Phase], probes: dict[str, dict[str, str]]) -> None:
    print(f"requests per phase {REQUESTS} x {ROUNDS} rounds, concurrency {CONCURRENCY}\n")
    print(
        "| phase | layer | req/s | Redis commands/req | Redis CPU µs/req "
        "| new Redis keys/req | non-2xx |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in ("new", "replay"):
        for layer in LAYERS:
            p = results[(layer, kind)]
            rate, commands = p.requests / p.seconds, p.commands / p.requests
            print(
                f"| {kind} | {layer} | {rate:.0f} | {commands:.2f} "
                f"| {1e6 * p.cpu / p.requests:.1f} | {p.new_keys / p.requests:.2f} | {p.non_2xx} |"
            )
    print("\nratios idem / powertools:")
    for kind in ("new", "replay"):
        i, t = results[("idem", kind)], results[("powertools", kind)]
        print(
            f"- {kind}: req/s {(i.requests / i.seconds) / (t.requests / t.seconds):.2f}x, "
            f"Redis commands {i.commands / max(t.commands, 1):.2f}x, "
            f"Redis CPU {i.cpu / max(t.cpu, 1e-9):.2f}x"
        )
    layers = list(probes)
    print("\n| probe | " + " | ".join(layers) + " |")
    print("|---" * (len(layers) + 1) + "|")
    for name in probes["idem"]:
        print(f"| {name} | " + " | ".join(probes[layer][name] for layer in layers) + " |")


if __name__ == "__main__":
    main()
