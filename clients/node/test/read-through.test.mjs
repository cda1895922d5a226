// ReadThrough against the module and the writer's table: a replay from the
// mirror refills Redis; no row is new; another fingerprint is a mismatch
// (and releases the key); expired and unfinished rows are ignored; an
// unreachable mirror is a PostgresError (unavailable) and releases the key;
// bad rows are Postgres errors.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import pg from "pg";
import * as idem from "../dist/index.js";
import { startRedis, database, key } from "./helpers.mjs";

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
