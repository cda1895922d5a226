// The peer benchmark: the idem Express middleware (MODE=idem) against the
// Powertools TypeScript idempotency utility with its Redis persistence layer
// (MODE=powertools), the same Express endpoint (server.mjs) on the same
// redis-server (with the idem module, on a free port). Load: new keys, then
// replays of them, for --seconds each at --concurrency requests in flight:
// requests/s, Redis commands per request (INFO commandstats), Redis CPU per
// request (INFO cpu), keys created; figures and idem/Powertools ratios from
// one run (--reverse measures Powertools first). Then the behaviour probes (concurrent duplicates, mismatch, 500
// then retry, a frozen holder past its lease with two instances), as a
// table. Usage: node run.mjs [--seconds 5] [--concurrency 32] [--reverse]
import { spawn } from "node:child_process";
import http from "node:http";
import { mkdtempSync, rmSync, existsSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { createClient } from "@redis/client";

const here = dirname(fileURLToPath(import.meta.url));
const repo = join(here, "..", "..");
const arg = (name, fallback) => {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? Number(process.argv[i + 1]) : fallback;
};
const SECONDS = arg("seconds", 5);
const CONCURRENCY = arg("concurrency", 32);
/** The order the two are measured in (--reverse: Powertools first). */
const MODES = process.argv.includes("--reverse") ? ["powertools", "idem"] : ["idem", "powertools"];
/** The probes also run Powertools with its payload validation on. */
const PROBED = { idem: ["idem", {}], powertools: ["powertools", {}], "powertools, validation on": ["powertools", { VALIDATE: "1" }] };
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const children = [];
const dirs = [];

async function freePort() {
  for (;;) {
    const port = 10000 + Math.floor(Math.random() * 20000);
    if (port === 6379 || port === 6390) continue;
    const free = await new Promise((resolve) => {
      const s = createServer();
      s.once("error", () => resolve(false));
      s.listen(port, "127.0.0.1", () => s.close(() => resolve(true)));
    });
    if (free) return port;
  }
}

function modulePath() {
  const p = process.env.IDEM_MODULE ?? join(repo, "target/release/module/libidem.so");
  if (!existsSync(p)) throw new Error(`the module is not built: ${p} (set IDEM_MODULE)`);
  return p;
}

async function startRedis() {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), "idem-node-peers-"));
  dirs.push(dir);
  const proc = spawn("redis-server", ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir, "--loadmodule", modulePath()], { stdio: "ignore" });
  children.push(proc);
  const url = `redis://127.0.0.1:${port}/`;
  for (let i = 0; i < 200; i++) {
    try {
      const c = createClient({ url, socket: { reconnectStrategy: false } });
      c.on("error", () => undefined);
      await c.connect();
      return { url, proc, client: c };
    } catch {
      await sleep(25);
    }
  }
  throw new Error("redis-server did not start");
}

async function startServer(mode, redisUrl, env = {}) {
  const port = await freePort();
  const proc = spawn(process.execPath, [join(here, "server.mjs")], {
    env: { ...process.env, MODE: mode, REDIS_URL: redisUrl, PORT: String(port), ...env },
    stdio: ["ignore", "pipe", "inherit"],
  });
  children.push(proc);
  await new Promise((resolve, reject) => {
    proc.stdout.on("data", (c) => String(c).includes("ready") && resolve());
    proc.once("exit", (code) => reject(new Error(`server ${mode} exited ${code}`)));
  });
  return { port, proc, stop: () => new Promise((resolve) => (proc.exitCode !== null ? resolve() : (proc.once("exit", resolve), proc.kill("SIGKILL")))) };
}

const agent = new http.Agent({ keepAlive: true, maxSockets: CONCURRENCY * 2 });
function post(port, { key, body = { amount: 100 }, query = "" }) {
  const payload = Buffer.from(JSON.stringify(body));
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: "127.0.0.1", port, method: "POST", path: `/payments${query}`, agent, headers: { "content-type": "application/json", "content-length": payload.length, "idempotency-key": key } },
      (res) => {
        const chunks = [];
        res.on("data", (c) => chunks.push(c));
        res.on("end", () => resolve({ status: res.statusCode, body: Buffer.concat(chunks).toString(), replayed: res.headers["idempotent-replayed"] === "true" }));
      },
    );
    req.on("error", reject);
    req.end(payload);
  });
}

async function stats(port) {
  return new Promise((resolve, reject) => {
    http.get({ host: "127.0.0.1", port, path: "/stats", agent }, (res) => {
      const chunks = [];
      res.on("data", (c) => chunks.push(c));
      res.on("end", () => resolve(JSON.parse(Buffer.concat(chunks).toString()).executions));
    }).on("error", reject);
  });
}

async function redisCounters(client) {
  const commands = await client.info("commandstats");
  let calls = 0;
  for (const m of commands.matchAll(/^cmdstat_([^:]+):calls=(\d+)/gm)) if (m[1] !== "info" && m[1] !== "config") calls += Number(m[2]);
  const cpu = await client.info("cpu");
  const num = (name) => Number(new RegExp(`^${name}:([0-9.]+)`, "m").exec(cpu)[1]);
  return { calls, cpu: num("used_cpu_user") + num("used_cpu_sys") };
}

/** `CONCURRENCY` workers for SECONDS; keyFor(i) gives the i-th request's key. */
async function load(port, keyFor) {
  let n = 0;
  let ok = 0;
  let replays = 0;
  const until = Date.now() + SECONDS * 1000;
  const worker = async () => {
    while (Date.now() < until) {
      const res = await post(port, { key: keyFor(n++) });
      if (res.status === 201) ok++;
      else if (process.env.DEBUG) console.error(res.status, res.body);
      if (res.replayed) replays++;
    }
  };
  const t0 = process.hrtime.bigint();
  await Promise.all(Array.from({ length: CONCURRENCY }, worker));
  return { requests: n, ok, replays, seconds: Number(process.hrtime.bigint() - t0) / 1e9 };
}

async function measure(mode, redis) {
  await redis.client.flushAll();
  const server = await startServer(mode, redis.url);
  // Warm-up (JIT, connections), not counted.
  const warm = `${mode}-warm-${Date.now()}`;
  const until = Date.now() + 1000;
  await Promise.all(Array.from({ length: CONCURRENCY }, async (_, w) => {
    for (let i = 0; Date.now() < until; i++) await post(server.port, { key: `${warm}-${w}-${i % 50}` });
  }));
  await redis.client.flushAll();
  const warmRuns = Object.values(await stats(server.port)).reduce((sum, x) => sum + x, 0);
  const prefix = `${mode}-${Date.now()}`;
  const out = {};
  for (const phase of ["new", "replay"]) {
    await redis.client.sendCommand(["CONFIG", "RESETSTAT"]);
    const before = await redisCounters(redis.client);
    const created = phase === "replay" ? out.new.requests : 0;
    const r = await load(server.port, (i) => (phase === "new" ? `${prefix}-${i}` : `${prefix}-${i % created}`));
    const after = await redisCounters(redis.client);
    out[phase] = {
      ...r,
      rps: r.requests / r.seconds,
      commandsPerRequest: (after.calls - before.calls) / r.requests,
      cpuUsPerRequest: ((after.cpu - before.cpu) * 1e6) / r.requests,
      keys: await redis.client.dbSize(),
    };
  }
  out.executions = Object.values(await stats(server.port)).reduce((sum, x) => sum + x, 0) - warmRuns;
  await server.stop();
  return out;
}

async function probes(mode, env, redis) {
  const rows = {};
  const a = await startServer(mode, redis.url, env);
  const b = await startServer(mode, redis.url, env);
  const id = `${mode}-${env.VALIDATE ?? 0}-${Date.now()}`;
  // Concurrent duplicates: 20 at once on one key, the handler taking 500 ms.
  const dup = await Promise.all(Array.from({ length: 20 }, () => post(a.port, { key: `${id}-dup`, query: "?ms=500" })));
  const statuses = {};
  for (const r of dup) statuses[r.status] = (statuses[r.status] ?? 0) + 1;
  rows["concurrent duplicates (20, handler 500 ms)"] = `runs ${(await stats(a.port))[`${id}-dup`] ?? 0}; ${Object.entries(statuses).map(([s, c]) => `${c}x${s}`).join(", ")}`;
  // A plain retry of a completed key, then the key reused for another body.
  await post(a.port, { key: `${id}-mm`, body: { amount: 1 } });
  const again = await post(a.port, { key: `${id}-mm`, body: { amount: 1 } });
  rows["same key, same body, completed"] = `${again.status}${again.replayed ? " replayed" : ""}`;
  const mm = await post(a.port, { key: `${id}-mm`, body: { amount: 2 } });
  const mmRuns = (await stats(a.port))[`${id}-mm`];
  rows["same key, another body"] = `${mm.status}${mm.status === 201 ? ` (runs ${mmRuns}: ${mmRuns === 1 ? "the first request's answer" : "ran again"})` : ""}`;
  // 500 then retry.
  const f1 = await post(a.port, { key: `${id}-500`, query: "?fail=1" });
  const f2 = await post(a.port, { key: `${id}-500`, query: "?fail=1" });
  rows["500, then the retry"] = `${f1.status} then ${f2.status} (runs ${(await stats(a.port))[`${id}-500`]})`;
  // A frozen holder: instance A takes the key and freezes (SIGSTOP) past the 1 s lease; the retry goes to B; A wakes.
  const held = post(a.port, { key: `${id}-frozen`, query: "?ms=1500" });
  await sleep(200);
  a.proc.kill("SIGSTOP");
  await sleep(1300);
  const retry = await post(b.port, { key: `${id}-frozen`, query: "?ms=1500" });
  a.proc.kill("SIGCONT");
  const first = await held;
  const runs = ((await stats(a.port))[`${id}-frozen`] ?? 0) + ((await stats(b.port))[`${id}-frozen`] ?? 0);
  const same = first.status === 201 && retry.status === 201 ? (first.body === retry.body ? "same body" : "two different bodies") : "";
  rows["frozen holder past its lease (two instances)"] = `retry ${retry.status}, the frozen one ${first.status}; runs ${runs}; ${same}`;
  await a.stop();
  await b.stop();
  return rows;
}

async function main() {
  const redis = await startRedis();
  const results = {};
  const probeRows = {};
  for (const mode of MODES) results[mode] = await measure(mode, redis);
  for (const [name, [mode, env]] of Object.entries(PROBED)) probeRows[name] = await probes(mode, env, redis);
  const [x, y] = [results.idem, results.powertools];
  const f = (v, d = 0) => v.toLocaleString("en-US", { maximumFractionDigits: d, minimumFractionDigits: d });
  console.log(`\nOne run: ${SECONDS} s per phase, ${CONCURRENCY} in flight, Express 5, the same redis-server (with the module), node ${process.version}\n`);
  console.log("| | idem | Powertools | idem / Powertools |");
  console.log("|---|---|---|---|");
  for (const phase of ["new", "replay"]) {
    console.log(`| ${phase} keys: requests/s | ${f(x[phase].rps)} | ${f(y[phase].rps)} | ${f(x[phase].rps / y[phase].rps, 2)}x |`);
    console.log(`| ${phase} keys: Redis commands per request | ${f(x[phase].commandsPerRequest, 2)} | ${f(y[phase].commandsPerRequest, 2)} | ${f(x[phase].commandsPerRequest / y[phase].commandsPerRequest, 2)}x |`);
    console.log(`| ${phase} keys: Redis CPU per request (us) | ${f(x[phase].cpuUsPerRequest, 1)} | ${f(y[phase].cpuUsPerRequest, 1)} | ${f(x[phase].cpuUsPerRequest / y[phase].cpuUsPerRequest, 2)}x |`);
  }
  console.log(`| keys created (new phase) | ${f(x.new.keys)} | ${f(y.new.keys)} | |`);
  console.log(`| replays answered as replays | ${f(x.replay.replays)} of ${f(x.replay.requests)} | (no replay header) ${f(y.replay.ok)} 201 of ${f(y.replay.requests)} | |`);
  console.log(`| handler runs / keys | ${f(x.executions)} / ${f(x.new.requests)} | ${f(y.executions)} / ${f(y.new.requests)} | |`);
  const names = Object.keys(PROBED);
  console.log(`\n| probe | ${names.join(" | ")} |`);
  console.log(`|---|${names.map(() => "---").join("|")}|`);
  for (const row of Object.keys(probeRows.idem)) console.log(`| ${row} | ${names.map((n) => probeRows[n][row]).join(" | ")} |`);
  await redis.client.close();
}

try {
  await main();
} finally {
  agent.destroy();
  for (const c of children) if (c.exitCode === null) c.kill("SIGKILL");
  for (const d of dirs) rmSync(d, { recursive: true, force: true });
}
