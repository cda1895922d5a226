// ReadThrough against the module and the writer's table: a replay from the
// mirror refills Redis; no row is new; another fingerprint is a mismatch
// (and releases the key); expired and unfinished rows are ignored; an
// unreachable mirror is a PostgresError (unavailable) and releases the key;
// a mirror that goes silent mid-lookup is bounded by the timeout and its
// connection destroyed; bad rows are Postgres errors.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer, connect } from "node:net";
import pg from "pg";
import * as idem from "../dist/index.js";
import { startRedis, database, key, sleep } from "./helpers.mjs";

const fp = (s) => Buffer.from(s.padEnd(32, "."));
const ttlMs = 60_000;
let client;
let db;
let rt;

before(async () => {
  const server = await startRedis();
  client = await idem.IdemClient.connect(server.url);
  db = await database();
  rt = new idem.ReadThrough(db.pool());
});
after(() => client.close());

async function mirror(k, fingerprint, { status = "completed", expires = "1 day", responseStatus = 201, headers = ["content-type", "application/json"] } = {}) {
  await db.pool().query(
    `INSERT INTO idempotency_keys (key, fingerprint, status, token, created_at, expires_at, response_status, response_body, response_headers, completed_at)
     VALUES ($1, $2, $3, 7, now(), now() + $4::interval, $5, $6, $7, now())`,
    [k, idem.storedHex(fingerprint), status, expires, status === "completed" ? responseStatus : null, Buffer.from('{"id":9}'), headers.map((h) => Buffer.from(h))],
  );
}

test("replays from the mirror and refills Redis (MIRRORED)", async () => {
  const k = key();
  await mirror(k, fp("a"));
  const expected = idem.storedResponse(201, '{"id":9}', [["content-type", "application/json"]]);
  assert.deepEqual(await rt.begin(client, k, fp("a"), { ttlMs }), { kind: "replay", response: expected });
  const rec = await client.get(k);
  assert.equal(rec.state, "completed");
  assert.equal(rec.mirror, "mirrored");
  assert.deepEqual(await client.begin(k, fp("a"), { ttlMs }), { kind: "replay", response: expected });
});

test("no row is new; another fingerprint is a mismatch and releases the key", async () => {
  const k = key();
  assert.equal((await rt.begin(client, k, fp("a"), { ttlMs })).kind, "new");
  const m = key();
  await mirror(m, fp("a"));
  assert.deepEqual(await rt.begin(client, m, fp("b"), { ttlMs }), { kind: "mismatch" });
  assert.equal(await client.get(m), null, "released");
});

test("expired and unfinished rows are ignored", async () => {
  const expired = key();
  await mirror(expired, fp("a"), { expires: "-1 second" });
  assert.equal((await rt.begin(client, expired, fp("a"), { ttlMs })).kind, "new");
  const unfinished = key();
  await mirror(unfinished, fp("a"), { status: "in_progress" });
  assert.equal((await rt.begin(client, unfinished, fp("a"), { ttlMs })).kind, "new");
});

test("a key Redis holds never reaches Postgres", async () => {
  const k = key();
  const { token } = await client.begin(k, fp("a"), { ttlMs });
  await client.complete(k, token, idem.storedResponse(200, "redis"));
  await mirror(k, fp("a"));
  const answer = await rt.begin(client, k, fp("a"), { ttlMs });
  assert.equal(answer.response.body.toString(), "redis");
});

test("an unreachable mirror is unavailable and releases the key", async () => {
  const dead = new pg.Pool({ connectionString: "postgresql://postgres@127.0.0.1:1/none", connectionTimeoutMillis: 500 });
  const k = key();
  const err = await new idem.ReadThrough(dead, { timeoutMs: 1000 }).begin(client, k, fp("a"), { ttlMs }).then(() => null, (e) => e);
  assert.ok(err instanceof idem.PostgresError, String(err));
  assert.ok(err.isUnavailable);
  assert.equal(await client.get(k), null, "released");
  await dead.end();
});

test("bad rows are Postgres errors", async () => {
  const k = key();
  await mirror(k, fp("a"), { headers: ["content-type"] });
  await assert.rejects(rt.begin(client, k, fp("a"), { ttlMs }), /odd number of header items/);
  assert.throws(() => idem.decodeRow("k", "ab", 99, Buffer.alloc(0), []), /status 99/);
});

/** A TCP proxy to `url`'s Postgres that, once `silence()` is called, drops every byte in both directions. */
async function silencingProxy(url) {
  const target = new URL(url);
  const sockets = new Set();
  let silent = false;
  const server = createServer((peer) => {
    const upstream = connect(Number(target.port || 5432), target.hostname);
    for (const s of [peer, upstream]) {
      sockets.add(s);
      s.on("error", () => undefined);
      s.on("close", () => sockets.delete(s));
    }
    peer.on("data", (chunk) => silent || upstream.write(chunk));
    upstream.on("data", (chunk) => silent || peer.write(chunk));
    peer.on("close", () => upstream.destroy());
    upstream.on("close", () => peer.destroy());
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const proxied = new URL(url);
  proxied.hostname = "127.0.0.1";
  proxied.port = String(server.address().port);
  return {
    url: proxied.toString(),
    silence: () => {
      silent = true;
    },
    async close() {
      for (const s of sockets) s.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

test("a mirror that goes silent mid-lookup is unavailable within the timeout, the key released and the connection destroyed", async () => {
  const proxy = await silencingProxy(db.url);
  const pool = new pg.Pool({ connectionString: proxy.url, max: 1 });
  pool.on("error", () => undefined);
  try {
    await pool.query("SELECT 1"); // an idle, connected client: the checkout succeeds at once
    proxy.silence();
    const k = key();
    const started = performance.now();
    const pending = new idem.ReadThrough(pool, { timeoutMs: 500 }).begin(client, k, fp("a"), { ttlMs }).then(() => null, (e) => e);
    const err = await Promise.race([pending, sleep(3000).then(() => "still pending after 3 s")]);
    assert.ok(err instanceof idem.PostgresError, String(err));
    assert.match(err.message, /no answer within 500 ms/);
    assert.ok(performance.now() - started < 1500, `took ${performance.now() - started} ms`);
    assert.equal(await client.get(k), null, "released");
    assert.equal(pool.totalCount, 0, "the silent connection was destroyed, not put back");
  } finally {
    await proxy.close(); // first: a client still checked out (a failing run) then ends with its socket
    await Promise.race([pool.end().catch(() => undefined), sleep(2000)]);
  }
});
