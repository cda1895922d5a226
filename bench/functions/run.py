#!/usr/bin/env python3
"""The Functions library (functions/idem.lua) against the module, on one
redis-server with both loaded (issue 37). Usage: bench/functions/run.py
(knobs in the environment: REQUESTS, KEYS, ROUNDS, CLIENTS, PIPELINE).

Per round, in alternating order (module first in even rounds, library first
in odd ones), each phase after CONFIG RESETSTAT:
  new       IDEM.BEGIN on fresh keys        vs FCALL idem_begin (redis-benchmark,
            -r 10^9, REQUESTS calls): calls/s and usec_per_call
  complete  IDEM.COMPLETE of KEYS records   vs FCALL idem_complete (to the
            key's slot outbox), tokens read from the BEGINs before, sent
            pipelined by this script's own client: usec_per_call only
  replay    IDEM.BEGIN ... PACKED of those completed records vs FCALL
            idem_begin ... PACKED, and both without PACKED (redis-benchmark,
            -r KEYS): calls/s and usec_per_call
usec_per_call is Redis' own time in the command (INFO commandstats:
idem.begin / idem.complete against fcall), the steady measure on a shared
machine. A ratio is the median of the per-round library/module ratios.
Every phase checks that no error reply was sent.
"""
import os, random, socket, statistics, subprocess, sys, tempfile, time, json, shutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = os.environ.get("IDEM_MODULE", "/work/main/target/release/module/libidem.so")
REQUESTS = int(os.environ.get("REQUESTS", "100000"))
KEYS = int(os.environ.get("KEYS", "50000"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))
CLIENTS = int(os.environ.get("CLIENTS", "50"))
PIPELINE = int(os.environ.get("PIPELINE", "16"))
FP = b"f" * 32
BODY = b"b" * 256
TTL = b"3600"
SLOTS = json.load(open(os.path.join(ROOT, "spec/outbox_slots.json")))


def crc16(data):  # XMODEM, as Redis Cluster hashes keys
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def outbox_key(key):
    s = key.find(b"{")
    if s >= 0:
        e = key.find(b"}", s + 1)
        if e > s + 1:
            key = key[s + 1:e]
    tag = SLOTS["tags"][crc16(key) % 16384]
    return (SLOTS["prefix"] + tag + SLOTS["suffix"]).encode()


def free_port():
    while True:
        p = random.randint(10000, 30000)
        if p in (6379, 6390):
            continue
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", p)) != 0:
                return p


class Conn:
    """A minimal RESP2 client: pipelines commands, reads replies."""

    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.buf = b""

    def _fill(self):
        d = self.s.recv(1 << 20)
        if not d:
            raise EOFError
        self.buf += d

    def _line(self):
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                l, self.buf = self.buf[:i], self.buf[i + 2:]
                return l
            self._fill()

    def reply(self):
        l = self._line()
        t, rest = l[:1], l[1:]
        if t in (b"+", b":"):
            return rest if t == b"+" else int(rest)
        if t == b"-":
            return RuntimeError(rest.decode())
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self._fill()
            v, self.buf = self.buf[:n], self.buf[n + 2:]
            return v
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise ValueError(l)

    @staticmethod
    def enc(args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def pipeline(self, cmds, batch=1000):
        res = []
        for i in range(0, len(cmds), batch):
            part = cmds[i:i + batch]
            self.s.sendall(b"".join(self.enc(c) for c in part))
            res.extend(self.reply() for _ in part)
        return res

    def call(self, *args):
        r = self.pipeline([args])[0]
        if isinstance(r, RuntimeError):
            raise r
        return r


def main():
    for tool in ("redis-server", "redis-benchmark"):
        if not shutil.which(tool):
            sys.exit(f"bench-functions: {tool} not found")
    if not os.path.isfile(MODULE):
        sys.exit(f"bench-functions: module {MODULE} does not exist")
    work = tempfile.mkdtemp(prefix="idem-fbench.")
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", work, "--logfile", work + "/redis.log",
         "--loadmodule", MODULE, "effect-format", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run(port)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


def run(port):
    for _ in range(600):
        try:
            c = Conn(port)
            if c.call("PING") == b"PONG":
                break
        except (OSError, EOFError):
            time.sleep(0.05)
    else:
        sys.exit("bench-functions: server not up")
    src = open(os.path.join(ROOT, "functions/idem.lua"), "rb").read()
    c.call("FUNCTION", "LOAD", "REPLACE", src)
    version = c.call("FCALL_RO", "idem_version", "0")
    # For scale: what FCALL itself costs (an empty function) and one HGET
    # from a function.
    c.call("FUNCTION", "LOAD", "REPLACE", b"#!lua name=idembenchbase\n"
           b"redis.register_function('idembench_noop', function(k, a) return 1 end)\n"
           b"redis.register_function('idembench_hget', function(k, a) return redis.call('HGET', k[1], 'x') end)\n")

    def info(section):
        out = {}
        for l in c.call("INFO", section).decode().splitlines():
            if ":" in l:
                k, v = l.split(":", 1)
                out[k] = v
        return out

    def errors():
        return int(info("stats")["total_error_replies"])

    def usec(cmd):
        v = info("commandstats").get("cmdstat_" + cmd)
        if v is None:
            raise SystemExit(f"bench-functions: no commandstats for {cmd}")
        return float(dict(kv.split("=") for kv in v.split(","))["usec_per_call"])

    def bench(n, r, *cmd):
        e = errors()
        out = subprocess.run(
            ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", str(CLIENTS),
             "-P", str(PIPELINE), "-n", str(n), "-r", str(r), "--csv", *cmd],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()
        rps = float(out[-1].split('","')[1])
        if errors() != e:
            raise SystemExit(f"bench-functions: error replies during {cmd}")
        return rps

    fk = lambda p, i: b"%s:%012d" % (p, i)  # as __rand_int__ fills (12 digits)
    R = {k: [] for k in ("mod_new", "lib_new", "mod_rep", "lib_rep", "mod_repf", "lib_repf")}
    U = {k: [] for k in ("noop", "hget", "mod_new", "lib_new", "mod_cmp", "lib_cmp", "mod_rep", "lib_rep", "mod_repf", "lib_repf")}
    # Each side's phase: (name, new-key command, begin of key i, complete of key i with token)
    sides = {
        "mod": dict(cmd="IDEM.BEGIN", ccmd="IDEM.COMPLETE",
                    new=["IDEM.BEGIN", "mn:__rand_int__", FP, TTL],
                    begin=lambda k: ["IDEM.BEGIN", k, FP, TTL],
                    complete=lambda k, t: ["IDEM.COMPLETE", k, t, "200", BODY],
                    rep=lambda packed: ["IDEM.BEGIN", "mc:__rand_int__", FP, TTL] + (["PACKED"] if packed else []),
                    prefix=b"mc"),
        "lib": dict(cmd="fcall", ccmd="fcall",
                    new=["FCALL", "idem_begin", "1", "fn:__rand_int__", FP, TTL],
                    begin=lambda k: ["FCALL", "idem_begin", "1", k, FP, TTL],
                    complete=lambda k, t: ["FCALL", "idem_complete", "2", k, outbox_key(k), t, "200", BODY],
                    rep=lambda packed: ["FCALL", "idem_begin", "1", "fc:__rand_int__", FP, TTL] + (["PACKED"] if packed else []),
                    prefix=b"fc"),
    }
    loads = []
    for rnd in range(ROUNDS):
        order = ["mod", "lib"] if rnd % 2 == 0 else ["lib", "mod"]
        loads.append(os.getloadavg()[0])
        c.call("FLUSHALL")
        for s in order:  # BEGIN on fresh keys
            side = sides[s]
            c.call("CONFIG", "RESETSTAT")
            R[s + "_new"].append(bench(REQUESTS, 10**9, *[x.decode() if isinstance(x, bytes) else x for x in side["new"]]))
            U[s + "_new"].append(usec(side["cmd"]))
        for s in order:  # COMPLETE with the tokens of BEGIN
            side = sides[s]
            keys = [fk(side["prefix"], i) for i in range(KEYS)]
            replies = c.pipeline([side["begin"](k) for k in keys])
            tokens = [r[1] for r in replies]
            assert all(r[0] == b"new" for r in replies), replies[:2]
            e = errors()
            c.call("CONFIG", "RESETSTAT")
            replies = c.pipeline([side["complete"](k, t) for k, t in zip(keys, tokens)])
            bad = [r for r in replies if isinstance(r, RuntimeError)]
            if bad or errors() != e:
                raise SystemExit(f"bench-functions: COMPLETE failed: {bad[:1]}")
            U[s + "_cmp"].append(usec(side["ccmd"]))
        for packed, tag in ((True, "_rep"), (False, "_repf")):
            for s in order:  # replays of those records
                side = sides[s]
                c.call("CONFIG", "RESETSTAT")
                cmd = [x.decode() if isinstance(x, bytes) else x for x in side["rep"](packed)]
                R[s + tag].append(bench(REQUESTS, KEYS, *cmd))
                U[s + tag].append(usec(side["cmd"]))
        # The replays must have been replays (a sample of each side).
        # (and both sides answer the same).
        got = {s: c.pipeline([sides[s]["begin"](fk(sides[s]["prefix"], i)) for i in (0, KEYS - 1)])
               for s in order}
        assert all(x[0] == b"replay" for x in got["mod"]), got["mod"][:1]
        assert got["mod"] == got["lib"], (got["mod"][:1], got["lib"][:1])
        c.call("CONFIG", "RESETSTAT")
        bench(REQUESTS, 1, "FCALL", "idembench_noop", "0")
        U["noop"].append(usec("fcall"))
        c.call("CONFIG", "RESETSTAT")
        bench(REQUESTS, KEYS, "FCALL", "idembench_hget", "1", "fc:__rand_int__")
        U["hget"].append(usec("fcall"))
        print(f"round {rnd + 1}/{ROUNDS} done (load {loads[-1]:.2f})", file=sys.stderr, flush=True)

    def paired(a, b):
        return statistics.median(x / y for x, y in zip(a, b))

    med = statistics.median
    print(f"idem: the Functions library (version {version if isinstance(version, int) else version.decode()}) against the module, one redis-server "
          f"({info('server')['redis_version']}) with both; {ROUNDS} rounds, alternating, medians")
    print(f"load average: before the rounds {loads[0]:.2f}, per round {' '.join('%.2f' % l for l in loads)}, "
          f"after {os.getloadavg()[0]:.2f} (2-core shared machine)")
    print()
    print(f"{'usec_per_call (commandstats)':44} {'module':>10} {'library':>10} {'lib/mod':>8}")
    print("-" * 76)
    for what, k in (("BEGIN new key", "new"), ("COMPLETE (256 B body)", "cmp"),
                    ("BEGIN replay, PACKED (256 B)", "rep"), ("BEGIN replay, four fields", "repf")):
        a, b = U["mod_" + k], U["lib_" + k]
        print(f"{what:44} {med(a):>8.2f}us {med(b):>8.2f}us {paired(b, a):>7.2f}x")
    print(f"{'for scale: FCALL of an empty function':44} {'':>10} {med(U['noop']):>8.2f}us")
    print(f"{'for scale: FCALL of one HGET (a record key)':44} {'':>10} {med(U['hget']):>8.2f}us")
    print()
    print(f"{'calls/s (redis-benchmark)':44} {'module':>10} {'library':>10} {'lib/mod':>8}")
    print("-" * 76)
    for what, k in (("BEGIN new key", "new"), ("BEGIN replay, PACKED (256 B)", "rep"),
                    ("BEGIN replay, four fields", "repf")):
        a, b = R["mod_" + k], R["lib_" + k]
        print(f"{what:44} {med(a):>10.0f} {med(b):>10.0f} {paired(b, a):>7.2f}x")
    print()
    print("per round (usec_per_call, module | library):")
    for k in ("new", "cmp", "rep", "repf"):
        print(f"  {k:5} {' '.join('%.2f' % x for x in U['mod_' + k])} | {' '.join('%.2f' % x for x in U['lib_' + k])}")
    print(f"  noop  {' '.join('%.2f' % x for x in U['noop'])} | hget {' '.join('%.2f' % x for x in U['hget'])}")
    print("per round (calls/s, module | library):")
    for k in ("new", "rep", "repf"):
        print(f"  {k:5} {' '.join('%.0f' % x for x in R['mod_' + k])} | {' '.join('%.0f' % x for x in R['lib_' + k])}")
    print(f"requests: {REQUESTS} per redis-benchmark phase ({CLIENTS} clients, pipeline {PIPELINE}), "
          f"{KEYS} completed records per side, fingerprint 32 B, body 256 B, no replica/AOF, effect-format 2")


if __name__ == "__main__":
    main()
