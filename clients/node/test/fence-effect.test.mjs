// Fence.commitEffect (spec/fence.json protocol.commit_effect) on the writer's
// table, in both layouts: the completion and the caller's one INSERT, UPDATE
// or DELETE commit together in one autocommitted statement, through a pool or
// a client outside any transaction; a holder that lost the key commits
// nothing and answers what the key holds (also when, on the partitioned
// layout, a takeover moved the row while the completion waited for the gate);
// an effect that fails, or whose gate cannot be taken in time, commits
// nothing and leaves the claim as it was; what is refused sends nothing.
import { test, before } from "node:test";
import assert from "node:assert/strict";
import pg from "pg";
import * as idem from "../dist/index.js";
import { database, key, sleep } from "./helpers.mjs";

const CREATED = idem.storedResponse(201, '{"id":1}', [["content-type", "application/json"]]);
const IN_FLIGHT = { kind: "in_flight", retryAfterMs: 1000 };
const PROCEED = { kind: "proceed" };
const COMMITTED = { kind: "committed" };
const PAY = "INSERT INTO payments (key, amount) VALUES ($7, $8)";
let nextToken = 2_000_000n;
const token = () => nextToken++;
const fp = (s) => Buffer.from(s);

const dbs = {};
before(async () => {
  dbs.unpartitioned = await database("unpartitioned");
  dbs.partitioned = await database("partitioned");
});

async function payments(pool, k) {
  const { rows } = await pool.query("SELECT count(*)::int AS n FROM payments WHERE key = $1", [k]);
  return rows[0].n;
}

/** The key's row as the test sees it: [status, token] or null. */
async function keyRow(pool, k) {
  const { rows } = await pool.query("SELECT status, token::text AS token FROM idempotency_keys WHERE key = $1", [k]);
  return rows.length === 0 ? null : [rows[0].status, rows[0].token];
}

/** `client` with its queries counted (what was sent through it). */
function counting(client) {
  const counted = { client, queries: 0 };
  const query = client.query;
  client.query = function (...args) {
    counted.queries += 1;
    return query.apply(this, args);
  };
  counted.restore = () => {
    client.query = query;
  };
  return counted;
}

for (const layout of ["unpartitioned", "partitioned"]) {
  const fence = (k, t, f, options = {}) => new idem.Fence(k, t, fp(f), 60_000, { layout, ...options });

  test(`${layout}: commitEffect commits the effect with the key's row, through a pool or a client, and tells the middleware`, async () => {
    const pool = dbs[layout].pool(1); // one connection: the call must give it back
    const k = key();
    const holder = fence(k, token(), "fp", { leaseMs: 30_000 });
    holder.report = new idem.FenceReport();
    assert.deepEqual(await holder.claim(pool), PROCEED);
    assert.deepEqual(await holder.commitEffect(pool, CREATED, PAY, [k, 10]), COMMITTED);
    assert.equal(holder.report.kind, "committed");
    assert.equal(holder.report.committed, CREATED);
    assert.equal(pool.totalCount - pool.idleCount, 0, "the pool's client given back");
    assert.equal(await payments(pool, k), 1);
    assert.deepEqual(await keyRow(pool, k), ["completed", holder.token.toString()]);
    assert.deepEqual(await fence(k, token(), "fp").claim(pool), { kind: "replay", response: CREATED });
    assert.deepEqual(await fence(k, token(), "other").claim(pool), { kind: "mismatch" });

    // A client outside any transaction; an UPDATE and a DELETE are effects too.
    const other = key();
    const conn = await pool.connect();
    try {
      const second = fence(other, token(), "fp");
      assert.deepEqual(await second.claim(conn), PROCEED);
      assert.deepEqual(await second.commitEffect(conn, CREATED, "update payments SET key = $7 WHERE key = $8", [other, k]), COMMITTED);
      assert.equal(conn.getTransactionStatus(), "I");
      const third = fence(key(), token(), "fp");
      assert.deepEqual(await third.claim(conn), PROCEED);
      assert.deepEqual(await third.commitEffect(conn, CREATED, "\n  Delete FROM payments WHERE key = $7", [other]), COMMITTED);
    } finally {
      conn.release();
    }
    assert.equal(await payments(pool, other), 0, "moved by the UPDATE, then deleted");
    assert.equal(await payments(pool, k), 0);
  });

  test(`${layout}: a holder that lost the key commits nothing: Lost(InFlight) while the retry holds it, then Lost(Replay)`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const slow = fence(k, token(), "fp", { leaseMs: 300 });
    slow.report = new idem.FenceReport();
    assert.deepEqual(await slow.claim(pool), PROCEED);
    await sleep(400);
    const retry = fence(k, token(), "fp", { leaseMs: 30_000 });
    assert.deepEqual(await retry.claim(pool), PROCEED);
    assert.deepEqual(await slow.commitEffect(pool, CREATED, PAY, [k, 10]), { kind: "lost", claim: IN_FLIGHT });
    assert.equal(slow.report.kind, "decided");
    assert.deepEqual(slow.report.claim, IN_FLIGHT);
    assert.equal(await payments(pool, k), 0, "the lost holder's effect not committed");
    assert.deepEqual(await keyRow(pool, k), ["in_progress", retry.token.toString()], "the retry's claim untouched");

    const answer = idem.storedResponse(201, "retry");
    assert.deepEqual(await retry.commitEffect(pool, answer, PAY, [k, 20]), COMMITTED);
    const conn = await pool.connect();
    try {
      assert.deepEqual(await slow.commitEffect(conn, CREATED, PAY, [k, 10]), { kind: "lost", claim: { kind: "replay", response: answer } });
      assert.equal(conn.getTransactionStatus(), "I");
    } finally {
      conn.release();
    }
    const { rows } = await pool.query("SELECT amount FROM payments WHERE key = $1", [k]);
    assert.deepEqual(rows, [{ amount: 20 }], "only the retry's payment");
  });

  test(`${layout}: an effect that fails (NOT NULL) commits nothing, leaves the claim in progress and raises its error`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const holder = fence(k, token(), "fp");
    holder.report = new idem.FenceReport();
    assert.deepEqual(await holder.claim(pool), PROCEED);
    await assert.rejects(
      holder.commitEffect(pool, CREATED, PAY, [null, 10]),
      (err) => err instanceof idem.PostgresError && err.cause?.code === "23502",
    );
    assert.equal(holder.report.kind, "claimed", "the middleware not told of a commit");
    assert.deepEqual(await keyRow(pool, k), ["in_progress", holder.token.toString()], "the completion not committed");
    assert.equal(await payments(pool, k), 0);
    // Still held: the corrected effect commits.
    assert.deepEqual(await holder.commitEffect(pool, CREATED, PAY, [k, 10]), COMMITTED);
    assert.equal(await payments(pool, k), 1);
  });

  test(`${layout}: an effect that is not one INSERT, UPDATE or DELETE, a bad response and a client in a transaction are refused, nothing sent`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const holder = fence(k, token(), "fp");
    assert.deepEqual(await holder.claim(pool), PROCEED);
    const conn = await pool.connect();
    const sent = counting(conn);
    try {
      for (const effect of [
        "SELECT 1",
        "select $7::text, $8::int",
        "WITH p AS (SELECT 1) INSERT INTO payments (key, amount) VALUES ($7, $8)",
        "(INSERT INTO payments (key, amount) VALUES ($7, $8))",
        "-- a payment\nINSERT INTO payments (key, amount) VALUES ($7, $8)",
        "INSERTED",
        "",
      ]) {
        await assert.rejects(holder.commitEffect(conn, CREATED, effect, [k, 10]), (err) => err instanceof idem.BadArgError && /INSERT, UPDATE or DELETE/.test(err.message), effect);
      }
      await assert.rejects(holder.commitEffect(conn, { status: 201, body: { amount: 10n }, headers: [] }, PAY, [k, 10]), TypeError);
      await assert.rejects(holder.commitEffect(conn, CREATED, PAY, "not an array"), TypeError);
      assert.equal(sent.queries, 0, "nothing sent");
      sent.restore();
      // Inside a transaction: refused, the caller's transaction left as it was.
      await conn.query("BEGIN");
      await conn.query("INSERT INTO payments (key, amount) VALUES ($1, 1)", [k]);
      const inside = counting(conn);
      await assert.rejects(
        holder.commitEffect(conn, CREATED, PAY, [k, 10]),
        (err) => err instanceof idem.PostgresError && /outside any transaction/.test(err.message) && /status T/.test(err.message),
      );
      assert.equal(inside.queries, 0, "nothing sent");
      inside.restore();
      assert.equal(conn.getTransactionStatus(), "T");
      await conn.query("ROLLBACK");
    } finally {
      sent.restore();
      conn.release();
    }
    assert.deepEqual(await keyRow(pool, k), ["in_progress", holder.token.toString()], "nothing changed");
    assert.equal(await payments(pool, k), 0);
  });

  test(`${layout}: the effect runs as written, trimmed, a trailing semicolon dropped`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const holder = fence(k, token(), "fp");
    assert.deepEqual(await holder.claim(pool), PROCEED);
    // `$$` is the effect's own (a dollar-quoted literal), not a replacement pattern.
    const effect = "  INSERT INTO payments (key, amount) VALUES ($7::text || $$-paid$$, $8) ;; \n";
    assert.deepEqual(await holder.commitEffect(pool, CREATED, effect, [k, 10]), COMMITTED);
    assert.equal(await payments(pool, `${k}-paid`), 1);
  });
}

test("a completion whose gate cannot be taken in time fails commitEffect with its error and commits nothing", async () => {
  const pool = dbs.unpartitioned.pool();
  const k = key();
  const holder = new idem.Fence(k, token(), fp("fp"), 60_000, { idleTimeoutMs: 200 });
  assert.deepEqual(await holder.claim(pool), PROCEED);
  const blocker = await pool.connect();
  try {
    await blocker.query("BEGIN");
    await blocker.query(`SELECT pg_advisory_xact_lock(hashtextextended($1, ${Number(idem.spec.fence().lock_seed)}))`, [k]);
    const err = await holder.commitEffect(pool, CREATED, PAY, [k, 10]).then(() => null, (e) => e);
    assert.ok(err instanceof idem.PostgresError, String(err));
    assert.equal(err.cause?.code, "55P03", `the completion's lock timeout: ${err.message}`);
  } finally {
    await blocker.query("ROLLBACK");
    blocker.release();
  }
  assert.deepEqual(await keyRow(pool, k), ["in_progress", holder.token.toString()], "nothing written");
  assert.equal(await payments(pool, k), 0);
});

test("an effect parameter node-postgres cannot encode fails commitEffect, commits nothing, and the client still works", async () => {
  const pool = dbs.unpartitioned.pool();
  const client = dbs.unpartitioned.pool(1, { pipeline: true });
  const k = key();
  const holder = new idem.Fence(k, token(), fp("fp"), 60_000);
  assert.deepEqual(await holder.claim(pool), PROCEED);
  const conn = await client.connect();
  try {
    // JSON.stringify of a BigInt throws in node-postgres' Bind: no Execute goes out.
    await assert.rejects(holder.commitEffect(conn, CREATED, PAY, [k, { amount: 10n }]), idem.PostgresError);
    assert.equal(conn.getTransactionStatus(), "I");
    assert.deepEqual(await keyRow(pool, k), ["in_progress", holder.token.toString()]);
    assert.equal(await payments(pool, k), 0);
    assert.deepEqual(await holder.commitEffect(conn, CREATED, PAY, [k, 10]), COMMITTED);
  } finally {
    conn.release();
  }
  assert.equal(await payments(pool, k), 1);
});

for (const pipeline of [true, false]) {
  const path = pipeline ? "pipelined" : "plain";

  test(`${path}: on the partitioned layout, a takeover that moves the row while the completion waits for the gate makes commitEffect Lost`, async () => {
    // Daily partitions from today to today + 3 (UTC): a 2-day takeover moves the row.
    const db = await database("daily");
    const setup = db.pool(1);
    const pool = new pg.Pool({ connectionString: db.url, max: 2, pipeline });
    pool.on("error", () => undefined);
    const taker = new pg.Client({ connectionString: db.url });
    await taker.connect();
    try {
      const k = key();
      const holder = new idem.Fence(k, token(), fp("fp"), 60_000, { leaseMs: 200, idleTimeoutMs: 5_000, layout: "partitioned" });
      assert.deepEqual(await holder.claim(pool), PROCEED);
      await sleep(400);
      await taker.query("BEGIN");
      const takeover = new idem.Fence(k, token(), fp("fp"), 2 * 86_400_000, { layout: "partitioned" });
      assert.deepEqual(await takeover.claimIn(taker), PROCEED);
      const { rows: old } = await setup.query("SELECT tableoid::regclass::text AS part FROM idempotency_keys WHERE key = $1", [k]);
      const pending = holder.commitEffect(pool, CREATED, PAY, [k, 10]).then((r) => r, (e) => e);
      await sleep(500); // the completion waits for the takeover's gate
      await taker.query("COMMIT");
      assert.deepEqual(await pending, { kind: "lost", claim: IN_FLIGHT });
      assert.equal(await payments(setup, k), 0, "the lost holder's effect not committed");
      const { rows } = await setup.query(
        "SELECT status, token::text AS token, tableoid::regclass::text AS part FROM idempotency_keys WHERE key = $1",
        [k],
      );
      assert.equal(rows.length, 1);
      assert.equal(rows[0].status, "in_progress");
      assert.equal(rows[0].token, takeover.token.toString());
      assert.notEqual(rows[0].part, old[0].part, "the takeover moved the row to another partition");
    } finally {
      await taker.end();
      await pool.end();
    }
  });
}
