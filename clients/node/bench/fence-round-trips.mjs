// Counts the Postgres round trips of one new fenced request through the
// middleware's flow (BEGIN new, the handler's claim, then its payment
// transaction: BEGIN, the fence's completion, COMMIT) with read-through's
// lookup, with claimUpFront, and with claimUpFront on a pipelined pool: the
// figures behind the README's claimUpFront and pipelining notes. Postgres is
// reached through a proxy that adds `delay` ms to each server answer and
// counts the client's flights (what it sends after an answer arrived).
// Usage: node bench/fence-round-trips.mjs <redis-url with the module> <admin postgres url> [requests] [delay ms]
// (creates a database of its own with the writer's migrations, and drops it).
import { connect, createServer } from "node:net";
import { randomUUID } from "node:crypto";
import { readdirSync, readFileSync } from "node:fs";
import pg from "pg";
import * as idem from "../dist/index.js";

const [redisUrl, adminUrl] = process.argv.slice(2);
const requests = Number(process.argv[4] ?? 20);
const delayMs = Number(process.argv[5] ?? 5);
if (!redisUrl || !adminUrl) throw new Error("usage: fence-round-trips.mjs <redis-url> <admin-postgres-url> [requests] [delay ms]");

const withDb = (url, name) => Object.assign(new URL(url), { pathname: `/${name}` }).toString();
async function admin(sql) {
  const c = new pg.Client({ connectionString: adminUrl });
  await c.connect();
  try {
    await c.query(sql);
  } finally {
    await c.end();
  }
}

/** A proxy adding `delayMs` to every server answer; `flights` counts the client's sends that follow an answer. */
async function proxy(target) {
  const stats = { flights: 0 };
  const server = createServer((client) => {
    const upstream = connect(Number(target.port || 5432), target.hostname);
    let answered = true;
    for (const s of [client, upstream]) {
      s.setNoDelay(true);
      s.on("error", () => undefined);
    }
    client.on("data", (chunk) => {
      if (answered) stats.flights++;
      answered = false;
      upstream.write(chunk);
    });
    upstream.on("data", (chunk) =>
      setTimeout(() => {
        answered = true;
        if (!client.destroyed) client.write(chunk);
      }, delayMs),
    );
    client.on("close", () => upstream.destroy());
    upstream.on("close", () => client.destroy());
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const url = new URL(target);
  url.hostname = "127.0.0.1";
  url.port = String(server.address().port);
  return { url: url.toString(), stats, close: () => server.close() };
}

const name = `idem_bench_${randomUUID().replaceAll("-", "").slice(0, 12)}`;
await admin(`CREATE DATABASE "${name}"`);
const dbUrl = withDb(adminUrl, name);
const client = await idem.IdemClient.connect(redisUrl);
try {
  const setup = new pg.Client({ connectionString: dbUrl });
  await setup.connect();
  const dir = new URL("../../../crates/idem-writer/migrations/", import.meta.url);
  const files = readdirSync(dir).filter((f) => f.endsWith(".sql") && f !== "0001_idempotency_keys_partitioned.sql").sort();
  for (const f of files) await setup.query(readFileSync(new URL(f, dir), "utf8"));
  await setup.end();
  const p = await proxy(new URL(dbUrl));
  const created = idem.storedResponse(201, '{"id":1}', [["content-type", "application/json"]]);
  const logger = { warn: () => undefined, error: (m) => console.error(m) };

  const variant = async (label, { claimUpFront, pipeline }) => {
    const pool = new pg.Pool({ connectionString: p.url, max: 1, pipeline });
    pool.on("error", () => undefined);
    await (await pool.connect()).release(); // the connection's setup is not counted
    const flow = new idem.Idempotency({ client, logger, readThrough: new idem.ReadThrough(pool), claimUpFront });
    const times = [];
    const before = p.stats.flights;
    for (let i = 0; i < requests; i++) {
      const started = performance.now();
      const request = { method: "POST", target: "/pay", headers: [["idempotency-key", Buffer.from(`bench-${i}-${randomUUID()}`)]], body: Buffer.from("{}") };
      const start = await flow.start(request);
      if (start.kind !== "run") throw new Error(`${label}: ${start.kind === "respond" ? start.response.body.toString() : start.kind}`);
      const fence = start.run.fence;
      if ((await fence.claim(pool)).kind !== "proceed") throw new Error(`${label}: claim`);
      const conn = await pool.connect();
      try {
        await conn.query("BEGIN");
        if ((await fence.commit(conn, created)).kind !== "committed") throw new Error(`${label}: commit`);
      } finally {
        conn.release();
      }
      const answer = await start.run.finish({ status: 201, headers: [], body: created.body });
      if (answer.status !== 201) throw new Error(`${label}: ${answer.status}`);
      times.push(performance.now() - started);
    }
    await flow.drain();
    await pool.end();
    times.sort((a, b) => a - b);
    const flights = (p.stats.flights - before) / requests;
    console.log(`${label.padEnd(34)} ${flights.toFixed(1)} Postgres round trips per request, median ${times[Math.floor(times.length / 2)].toFixed(1)} ms`);
  };

  console.log(`${requests} new fenced requests each, one at a time, ${delayMs} ms added to each Postgres answer:`);
  await variant("read-through lookup", { claimUpFront: false, pipeline: false });
  await variant("claimUpFront", { claimUpFront: true, pipeline: false });
  await variant("claimUpFront, pipelined pool", { claimUpFront: true, pipeline: true });
  p.close();
} finally {
  await client.close();
  await admin(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
}
