"""The peer benchmark, one method for every language (issue 39): idem's
middleware against AWS Powertools' idempotency utility, the same handler in
the same server process (Python: bench/python-peers/app.py) or one process
each (Node: bench/node-peers/server.mjs), on the same redis-server (with
the module, a free port), loaded by one compiled load generator, wrk (Debian's
4.1.0), with bench/peers/keys.lua giving every request a fresh
Idempotency-Key (new) or one of a fixed set of completed keys (replay).

Per language: ``--rounds`` rounds (5), idem and the peer alternating which
goes first; in each, per layer: FLUSHALL, ``--replay-keys`` keys completed
one by one, then ``--seconds`` of new keys and ``--seconds`` of replays.
Measured per phase: requests/s (wrk), the server process' CPU per request
(utime + stime of /proc/PID/stat), Redis CPU per request as the commands'
own time (INFO commandstats usec, not the process' CPU), commands per
request, handler runs per request (the apps' counters). Reported: medians
and ranges over the rounds, idem / peer ratios paired per round (median and
range), the targets next to them, the machine's load average, and last one
line per language a script can read:

    peers: <python|node> new <ratio>x replay <ratio>x redis-cpu-new <ratio>x
    peers-cpu: <python|node> new <ratio>x replay <ratio>x

(the second: requests per CPU-second of the server, the inverse ratio of
server CPU per request; on a shared machine req/s also measures how the
scheduler shares the core out, and a process with many threads, as
Powertools' thread pool in Python, gets more of it than a one-thread event
loop).

wrk and redis-server run on the last CPU, the servers on the others
(taskset), when the machine has at least 2. The behaviour probes of
bench/python-peers and bench/node-peers run afterwards (``--no-probes``).
Run by bench/peers/run.sh (scripts/bench.sh peers)."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LUA = HERE / "keys.lua"
TARGET_RPS = 1.2
TARGET_REDIS_CPU = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Commands the driver itself sends between phases, left out of the figures.
OWN_COMMANDS = {"info", "flushall", "config|resetstat", "config", "ping", "dbsize", "client"}


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in (6379, 6390):
            return port


def wait_for(check: Callable[[], Any], within: float = 60) -> None:
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if time.monotonic() > deadline:
            raise RuntimeError("not up in time")
        time.sleep(0.05)


def cpus() -> tuple[list[str], list[str]]:
    """(load generator + Redis, servers): taskset prefixes."""
    n = os.cpu_count() or 1
    if n < 2 or not shutil.which("taskset"):
        return [], []
    return ["taskset", "-c", str(n - 1)], ["taskset", "-c", f"0-{n - 2}" if n > 2 else "0"]


LOADGEN_CPU, SERVER_CPU = cpus()


def proc_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def commandstats(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """command -> (calls, usec)."""
    out = {}
    for name, v in r.info("commandstats").items():
        cmd = name.removeprefix("cmdstat_")
        if cmd not in OWN_COMMANDS:
            out[cmd] = (int(v["calls"]), int(v["usec"]))
    return out


def post(port: int, path: str, key: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request(
            "POST",
            path,
            body=b'{"amount":100}',
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )
        reply = c.getresponse()
        return reply.status, reply.read()
    finally:
        c.close()


@dataclass
class Server:
    """One layer's endpoint: a process, a port, a path, and its handler-run
    counter."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    path: str
    runs: Callable[[], int]


@dataclass
class Phase:
    rps: float
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    server_cpu_us: float
    redis_us: float
    commands: float
    runs: float
    per_command: dict[str, tuple[float, float]] = field(default_factory=dict)


def wrk(server: Server, args: list[str], seconds: float, connections: int) -> dict[str, Any]:
    cmd = [
        *LOADGEN_CPU,
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
        f"http://127.0.0.1:{server.port}",
        "--",
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    m = re.search(r"^PEERS (\{.*\})$", out, re.M)
    if not m:
        raise RuntimeError(f"wrk printed no PEERS line:\n{out}")
    return json.loads(m.group(1))


def phase(
    r: redis.Redis, server: Server, args: list[str], seconds: float, connections: int
) -> Phase:
    stats0, cpu0, runs0 = commandstats(r), proc_cpu(server.proc.pid), server.runs()
    out = wrk(server, args, seconds, connections)
    stats1, cpu1, runs1 = commandstats(r), proc_cpu(server.proc.pid), server.runs()
    n = max(out["requests"], 1)
    per_command = {}
    calls = usec = 0
    for cmd, (c1, u1) in stats1.items():
        c0, u0 = stats0.get(cmd, (0, 0))
        if c1 - c0:
            per_command[cmd] = ((c1 - c0) / n, (u1 - u0) / n)
            calls += c1 - c0
            usec += u1 - u0
    errors = sum(out[k] for k in ("non_2xx_3xx", "connect", "read", "write", "timeout"))
    return Phase(
        rps=out["requests"] / (out["duration_us"] / 1e6),
        requests=out["requests"],
        errors=errors,
        p50_ms=out["p50_us"] / 1000,
        p99_ms=out["p99_us"] / 1000,
        server_cpu_us=(cpu1 - cpu0) * 1e6 / n,
        redis_us=usec / n,
        commands=calls / n,
        runs=(runs1 - runs0) / n,
        per_command=per_command,
    )


def measure(
    r: redis.Redis, server: Server, opts: argparse.Namespace, tag: str
) -> tuple[Phase, Phase]:
    """FLUSHALL, the replay keys completed one by one, then new keys and
    replays for ``opts.seconds`` each."""
    r.flushall()
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}"
    for i in range(opts.replay_keys):
        status, body = post(server.port, server.path, f"{prefix}-r-{i}")
        if not 200 <= status < 300:
            raise RuntimeError(f"{server.name}: seeding answered {status}: {body[:200]!r}")
    new = phase(r, server, ["new", f"{prefix}-n", server.path], opts.seconds, opts.connections)
    replay = phase(
        r,
        server,
        ["replay", f"{prefix}-r", server.path, str(opts.replay_keys)],
        opts.seconds,
        opts.connections,
    )
    return new, replay


# ---------------------------------------------------------------- languages


def start(
    cmd: list[str], env: dict[str, str], cwd: Path, log: Path, ready: Callable[[], Any]
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*SERVER_CPU, *cmd], cwd=cwd, env={**os.environ, **env}, stdout=out, stderr=out
        )
    try:
        wait_for(lambda: proc.poll() is None and ready())
    except RuntimeError:
        proc.kill()
        raise RuntimeError(f"{cmd} did not come up: {log.read_text()[-2000:]}") from None
    return proc


def http_json(port: int, path: str) -> Any:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path)
        return json.loads(c.getresponse().read())
    finally:
        c.close()


@contextlib.contextmanager
def python_servers(redis_url: str, tmp: Path, opts: argparse.Namespace) -> Iterator[list[Server]]:
    """One uvicorn process of bench/python-peers/app.py serving both."""
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "app:app", "--port", str(port)]
    cmd += ["--log-level", "warning", "--no-access-log"]
    proc = start(
        cmd,
        {"REDIS_URL": redis_url},
        REPO / "bench/python-peers",
        tmp / "python.log",
        lambda: http_json(port, "/runs"),
    )
    try:

        def runs() -> int:
            return int(http_json(port, "/runs")["runs"])

        yield [
            Server("idem", proc, port, "/idem/payments", runs),
            Server("powertools", proc, port, "/pt/payments", runs),
        ]
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def node_servers(redis_url: str, tmp: Path, opts: argparse.Namespace) -> Iterator[list[Server]]:
    """bench/node-peers/server.mjs twice: MODE=idem and MODE=powertools."""
    servers, procs = [], []
    try:
        for mode in ("idem", "powertools"):
            port = free_port()
            flags = []
            if opts.node_prof and mode == "idem":
                flags = ["--cpu-prof", "--cpu-prof-dir", opts.node_prof, "--import", str(HERE / "exit-on-term.mjs")]
            proc = start(
                ["node", *flags, "server.mjs"],
                {"MODE": mode, "REDIS_URL": redis_url, "PORT": str(port)},
                REPO / "bench/node-peers",
                tmp / f"node-{mode}.log",
                lambda p=port: http_json(p, "/stats") is not None,
            )
            procs.append(proc)

            def runs(p: int = port) -> int:
                return int(sum(http_json(p, "/stats")["executions"].values()))

            servers.append(Server(mode, proc, port, "/payments", runs))
        yield servers
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


LANGUAGES = {"python": python_servers, "node": node_servers}


# ---------------------------------------------------------------- report


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def span(xs: list[float], fmt: str) -> str:
    return f"{format(med(xs), fmt)} ({format(min(xs), fmt)}–{format(max(xs), fmt)})"


def verdict(ratio: float, target: float, higher: bool) -> str:
    ok = ratio >= target if higher else ratio <= target
    return f"target {'≥' if higher else '≤'} {target:.1f}x: {'met' if ok else 'MISSED'}"


def run_language(lang: str, r: redis.Redis, redis_url: str, tmp: Path, opts: argparse.Namespace) -> str:
    print(f"\n== {lang}: idem against Powertools ==")
    print(f"load average before: {loadavg()}")
    results: dict[str, dict[str, list[Phase]]] = {
        name: {"new": [], "replay": []} for name in ("idem", "powertools")
    }
    with LANGUAGES[lang](redis_url, tmp, opts) as servers:
        by_name = {s.name: s for s in servers}
        # Warm-up, not counted: a second of each (imports, JIT, pools).
        for s in servers:
            wrk(s, ["new", f"warm-{s.name}", s.path], 1, opts.connections)
        for round_ in range(opts.rounds):
            order = ["idem", "powertools"] if round_ % 2 == 0 else ["powertools", "idem"]
            for name in order:
                new, replay = measure(r, by_name[name], opts, f"{lang}-{name}-{round_}")
                results[name]["new"].append(new)
                results[name]["replay"].append(replay)
                print(
                    f"  round {round_ + 1} {name:10} new {new.rps:7.0f} req/s "
                    f"replay {replay.rps:7.0f} req/s  (load {loadavg()})",
                    flush=True,
                )
    print(f"load average after: {loadavg()}")
    print(
        f"\n{opts.rounds} rounds x {opts.seconds:g} s per phase, wrk -t1 -c{opts.connections}, "
        f"{opts.replay_keys} replay keys; medians (min–max) over the rounds"
    )
    print(
        "\n| phase | layer | req/s | p50 / p99 ms | server CPU µs/req | server busy "
        "| Redis µs/req (commandstats) | Redis commands/req | handler runs/req | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in ("new", "replay"):
        for name in ("idem", "powertools"):
            ps = results[name][kind]
            print(
                f"| {kind} | {name} | {span([p.rps for p in ps], '.0f')} "
                f"| {med([p.p50_ms for p in ps]):.1f} / {med([p.p99_ms for p in ps]):.1f} "
                f"| {span([p.server_cpu_us for p in ps], '.0f')} "
                f"| {med([p.server_cpu_us * p.rps / 1e4 for p in ps]):.0f}% "
                f"| {span([p.redis_us for p in ps], '.1f')} "
                f"| {med([p.commands for p in ps]):.2f} | {med([p.runs for p in ps]):.2f} "
                f"| {sum(p.errors for p in ps)} |"
            )
    print("\nRedis commands per request, µs per request (the last round's):")
    for kind in ("new", "replay"):
        for name in ("idem", "powertools"):
            cmds = results[name][kind][-1].per_command
            text = ", ".join(
                f"{c} {calls:.2f}x {us:.1f} µs" for c, (calls, us) in sorted(cmds.items())
            )
            print(f"- {kind} {name}: {text}")

    def ratios(kind: str, attr: str) -> list[float]:
        return [
            getattr(i, attr) / max(getattr(t, attr), 1e-9)
            for i, t in zip(results["idem"][kind], results["powertools"][kind], strict=True)
        ]

    new, replay = ratios("new", "rps"), ratios("replay", "rps")
    cpu_new, cpu_replay = ratios("new", "redis_us"), ratios("replay", "redis_us")
    srv_new, srv_replay = ratios("new", "server_cpu_us"), ratios("replay", "server_cpu_us")
    print("\nidem / Powertools, paired per round: median (min–max)")
    print(f"- new keys req/s:        {span(new, '.2f')}x  {verdict(med(new), TARGET_RPS, True)}")
    print(f"- replays req/s:         {span(replay, '.2f')}x  {verdict(med(replay), TARGET_RPS, True)}")
    print(
        f"- Redis µs per new key:  {span(cpu_new, '.2f')}x  "
        f"{verdict(med(cpu_new), TARGET_REDIS_CPU, False)}"
    )
    print(f"- Redis µs per replay:   {span(cpu_replay, '.2f')}x")
    print(f"- server CPU per new key: {span(srv_new, '.2f')}x; per replay: {span(srv_replay, '.2f')}x")
    # Requests per CPU-second of the server: what one core would serve, free
    # of how the shared machine's scheduler shares the core out.
    cap_new, cap_replay = [1 / x for x in srv_new], [1 / x for x in srv_replay]
    print(
        f"- requests per server CPU-second, new keys: {span(cap_new, '.2f')}x  "
        f"{verdict(med(cap_new), TARGET_RPS, True)}"
    )
    print(
        f"- requests per server CPU-second, replays: {span(cap_replay, '.2f')}x  "
        f"{verdict(med(cap_replay), TARGET_RPS, True)}"
    )
    return (
        f"peers: {lang} new {med(new):.2f}x replay {med(replay):.2f}x "
        f"redis-cpu-new {med(cpu_new):.2f}x\n"
        f"peers-cpu: {lang} new {med(cap_new):.2f}x replay {med(cap_replay):.2f}x"
    )


def probes(lang: str) -> None:
    """The behaviour probes of the language's old harness, as they were."""
    print(f"behaviour probes ({lang}):")
    if lang == "python":
        sys.path.insert(0, str(REPO / "bench/python-peers"))
        import asyncio

        import bench as old  # bench/python-peers/bench.py

        # Its 30 s for the apps to come up is short on a loaded machine.
        wait = old.wait_for
        old.wait_for = lambda check, within=180: wait(check, within)
        with (
            tempfile.TemporaryDirectory(prefix="idem-peers-probes-") as d,
            old.processes(Path(d)) as (_, apps),
        ):
            table = asyncio.run(old.probes(apps))
        layers = list(table)
        print("| probe | " + " | ".join(layers) + " |")
        print("|---" * (len(layers) + 1) + "|")
        for name in table["idem"]:
            print(f"| {name} | " + " | ".join(table[layer][name] for layer in layers) + " |")
    else:
        # run.mjs measures briefly, then probes; only its probe table is kept.
        out = subprocess.run(
            ["node", str(REPO / "bench/node-peers/run.mjs"), "--seconds", "1", "--concurrency", "4"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("| probe"))
        print("\n".join(lines[start:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4, help="per phase (4)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (5)")
    ap.add_argument("--connections", type=int, default=32, help="wrk connections (32)")
    ap.add_argument("--replay-keys", type=int, default=100, help="completed keys replayed (100)")
    ap.add_argument("--languages", default="python,node", help="python,node")
    ap.add_argument("--no-probes", dest="probes", action="store_false")
    ap.add_argument("--node-prof", help="write a --cpu-prof of the idem Node server here")
    opts = ap.parse_args()
    if opts.rounds < 1:
        ap.error("--rounds must be at least 1")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"peers bench {started}; {os.cpu_count()} CPUs; load average {loadavg()}")
    print(
        f"wrk and redis-server pinned with {' '.join(LOADGEN_CPU) or '(no taskset)'}, "
        f"the servers with {' '.join(SERVER_CPU) or '(no taskset)'}"
    )
    print(f"wrk: {subprocess.run(['wrk', '-v'], capture_output=True, text=True).stdout.splitlines()[0]}")
    lines = []
    with tempfile.TemporaryDirectory(prefix="idem-peers-") as d:
        tmp = Path(d)
        module = tmp / "libidem.so"
        shutil.copy2(os.environ["IDEM_MODULE"], module)
        port = free_port()
        rs = subprocess.Popen(
            [*LOADGEN_CPU, "redis-server", "--port", str(port), "--bind", "127.0.0.1"]
            + ["--save", "", "--appendonly", "no", "--dir", d, "--loadmodule", str(module)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            r = redis.Redis(port=port)
            wait_for(r.ping)
            print(f"redis-server {r.info('server')['redis_version']} with the module on port {port}")
            for lang in opts.languages.split(","):
                lines.append(run_language(lang, r, f"redis://127.0.0.1:{port}/", tmp, opts))
        finally:
            rs.kill()
            rs.wait()
    if opts.probes:
        for lang in opts.languages.split(","):
            print()
            try:
                probes(lang)
            except Exception as err:  # the figures above stand without them
                print(f"the {lang} probes failed: {err!r}")
    print()
    for line in lines:
        print(line)
    print("peers: rust skipped (the idempotent crate's harness is not in the repo)")


if __name__ == "__main__":
    main()
