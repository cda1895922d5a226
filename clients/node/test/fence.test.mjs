// The Postgres fence on the writer's table, in both layouts: durable claims
// with a lease, completion only while held, takeover after the lease (the
// lost holder commits nothing), release, hold, the one-transaction shape,
// concurrency, and the idle timeout that frees a frozen claimer's gate (run
// once without it: teeth); commit pipelined (completion and COMMIT in one
// round trip) and not, each ending the session outside any transaction; a
// response that cannot be encoded commits nothing, and a row a takeover moved
// to another partition makes commit Lost.
import { test, before } from "node:test";
import assert from "node:assert/strict";
import pg from "pg";
import * as idem from "../dist/index.js";
import { database, key, sleep } from "./helpers.mjs";

const CREATED = idem.storedResponse(201, '{"id":1}', [["content-type", "application/json"]]);
const IN_FLIGHT = { kind: "in_flight", retryAfterMs: 1000 };
const PROCEED = { kind: "proceed" };
const COMMITTED = { kind: "committed" };
let nextToken = 1_000_000n;
const token = () => nextToken++;
const fp = (s) => Buffer.from(s);

const dbs = {};
before(async () => {
  dbs.unpartitioned = await database("unpartitioned");
  dbs.partitioned = await database("partitioned");
});

async function pay(conn, k, amount = 10) {
  await conn.query("INSERT INTO payments (key, amount) VALUES ($1, $2)", [k, amount]);
}

async function payments(pool, k) {
  const { rows } = await pool.query("SELECT count(*)::int AS n FROM payments WHERE key = $1", [k]);
  return rows[0].n;
}

/** BEGIN on a pooled client, `f`, then release. */
async function inTransaction(pool, f) {
  const conn = await pool.connect();
  try {
    await conn.query("BEGIN");
    return await f(conn);
  } finally {
    await conn.query("ROLLBACK").catch(() => undefined);
    conn.release();
  }
}

for (const layout of ["unpartitioned", "partitioned"]) {
  const fence = (k, t, f, options = {}) => new idem.Fence(k, t, fp(f), 60_000, { layout, ...options });

  test(`${layout}: claim, commit, replay; a live claim keeps others out`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const holder = fence(k, token(), "fp", { leaseMs: 30_000 });
    assert.deepEqual(await holder.claim(pool), PROCEED);
    // While the lease runs, another holder (a retry Redis let in) waits.
    assert.deepEqual(await fence(k, token(), "fp").claim(pool), IN_FLIGHT);
    assert.deepEqual(await fence(k, token(), "other").claim(pool), { kind: "mismatch" });
    await inTransaction(pool, async (conn) => {
      await pay(conn, k);
      assert.deepEqual(await holder.commit(conn, CREATED), COMMITTED);
    });
    assert.equal(await payments(pool, k), 1);
    assert.deepEqual(await fence(k, token(), "fp").claim(pool), { kind: "replay", response: CREATED });
    assert.deepEqual(await fence(k, token(), "other").claim(pool), { kind: "mismatch" });
    // Claiming again with the holder's own token is idempotent until completed.
    const same = fence(key(), token(), "fp");
    assert.deepEqual(await same.claim(pool), PROCEED);
    assert.deepEqual(await same.claim(pool), PROCEED);
  });

  test(`${layout}: the claim lasts its lease; then a retry takes over and the lost holder commits nothing`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const slow = fence(k, token(), "fp", { leaseMs: 300 });
    assert.deepEqual(await slow.claim(pool), PROCEED);
    await sleep(150);
    assert.deepEqual(await fence(k, token(), "fp").claim(pool), IN_FLIGHT, "within the lease");
    await sleep(250);
    const retry = fence(k, token(), "fp", { leaseMs: 30_000 });
    assert.deepEqual(await retry.claim(pool), PROCEED);
    await inTransaction(pool, async (conn) => {
      await pay(conn, k);
      assert.deepEqual(await slow.commit(conn, CREATED), { kind: "lost", claim: IN_FLIGHT });
    });
    assert.equal(await payments(pool, k), 0, "the stale holder's effect rolled back");
    const answer = idem.storedResponse(201, "retry");
    await inTransaction(pool, async (conn) => {
      await pay(conn, k);
      assert.deepEqual(await retry.commit(conn, answer), COMMITTED);
    });
    assert.equal(await payments(pool, k), 1);
    // The stale holder now finds the retry's answer.
    await inTransaction(pool, async (conn) => {
      assert.deepEqual(await slow.commit(conn, CREATED), { kind: "lost", claim: { kind: "replay", response: answer } });
    });
  });

  test(`${layout}: release lets the next claim proceed at once; hold renews the lease`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const first = fence(k, token(), "fp", { leaseMs: 30_000 });
    assert.deepEqual(await first.claim(pool), PROCEED);
    await first.release(pool);
    assert.deepEqual(await fence(k, token(), "fp").claim(pool), PROCEED);

    const h = key();
    // Lease 1 s: renewed at 0.7 s, checked 0.5 s later (past the first lease, within the renewed one with room
    // for a loaded machine: a 300 ms lease failed there once).
    const holder = fence(h, token(), "fp", { leaseMs: 1000 });
    assert.deepEqual(await holder.claim(pool), PROCEED);
    await sleep(700);
    await inTransaction(pool, async (conn) => {
      assert.deepEqual(await holder.hold(conn), { kind: "held" });
      await conn.query("COMMIT");
    });
    await sleep(500); // past the first lease, within the renewed one
    assert.deepEqual(await fence(h, token(), "fp").claim(pool), IN_FLIGHT);
  });

  test(`${layout}: the one-transaction shape (claimIn): a rollback takes the claim with it`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    await inTransaction(pool, async (conn) => {
      assert.deepEqual(await fence(k, token(), "fp").claimIn(conn), PROCEED);
      await pay(conn, k);
    });
    const second = fence(k, token(), "fp");
    await inTransaction(pool, async (conn) => {
      assert.deepEqual(await second.claimIn(conn), PROCEED);
      // An open holder's transaction makes others InFlight at once.
      assert.deepEqual(await fence(k, token(), "fp").claim(pool), IN_FLIGHT);
      await pay(conn, k);
      assert.deepEqual(await second.commit(conn, CREATED), COMMITTED);
    });
    assert.equal(await payments(pool, k), 1);
    assert.deepEqual(await fence(k, token(), "fp").claim(pool), { kind: "replay", response: CREATED });
  });

  test(`${layout}: twelve concurrent holders commit one effect`, async () => {
    const pool = dbs[layout].pool(12);
    const k = key();
    const answers = await Promise.all(
      Array.from({ length: 12 }, async () => {
        const f = fence(k, token(), "fp", { leaseMs: 30_000 });
        const claim = await f.claim(pool);
        if (claim.kind !== "proceed") return claim;
        return inTransaction(pool, async (conn) => {
          await pay(conn, k);
          return f.commit(conn, CREATED);
        });
      }),
    );
    assert.equal(await payments(pool, k), 1);
    assert.equal(answers.filter((a) => a.kind === "committed").length, 1);
    for (const a of answers) assert.ok(["committed", "in_flight", "replay"].includes(a.kind), JSON.stringify(a));
  });

  test(`${layout}: a durable claim through one client outside a transaction`, async () => {
    const conn = new pg.Client({ connectionString: dbs[layout].url });
    await conn.connect();
    try {
      await conn.query("SET default_transaction_isolation = 'repeatable read'");
      const k = key();
      const f = fence(k, token(), "fp");
      assert.deepEqual(await f.claim(conn), PROCEED);
      assert.deepEqual(await fence(k, token(), "fp").claim(conn), IN_FLIGHT);
      await f.release(conn);
      assert.deepEqual(await fence(k, token(), "fp").claim(conn), PROCEED);
    } finally {
      await conn.end();
    }
  });
}

test("the downstream key follows the request, not the token", () => {
  const first = new idem.Fence("idem:{a:k}", 10n, fp("fp"), 60_000);
  assert.equal(first.downstreamKey(), new idem.Fence("idem:{a:k}", 20n, fp("fp"), 60_000).downstreamKey());
  assert.equal(first.downstreamKey(), idem.downstreamKey("idem:{a:k}", fp("fp")));
  assert.notEqual(first.downstreamKey(), new idem.Fence("idem:{a:k}", 30n, fp("x"), 60_000).downstreamKey());
  assert.throws(() => new idem.Fence("k", 0n, fp("fp"), 60_000), /positive/);
});

test("partitioned: a stricter transaction is refused, and the default layout's claim says the table is partitioned", async () => {
  const pool = dbs.partitioned.pool();
  await inTransaction(pool, async (conn) => {
    await conn.query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ");
    await assert.rejects(new idem.Fence(key(), token(), fp("fp"), 60_000, { layout: "partitioned" }).claimIn(conn), /READ COMMITTED/);
  });
  await assert.rejects(new idem.Fence(key(), token(), fp("fp"), 60_000).claim(pool), (err) => err instanceof idem.PostgresError && /looks partitioned/.test(err.message));
});

/** A partitioned claimer that freezes between its two statements; answers what a retry's claim finds meanwhile. */
async function frozenClaimer(idleTimeoutMs) {
  const url = dbs.partitioned.url;
  const k = key();
  const frozen = new idem.Fence(k, token(), fp("fp"), 60_000, { leaseMs: 400, idleTimeoutMs, layout: "partitioned" });
  const raw = frozen.raw.bind(frozen);
  frozen.raw = async (conn, name, params) => {
    const row = await raw(conn, name, params);
    if (name === "partitioned_gate") await sleep(2000);
    return row;
  };
  const conn = new pg.Client({ connectionString: url });
  conn.on("error", () => undefined);
  await conn.connect();
  const claiming = frozen.claim(conn).then(() => null, (err) => err);
  await sleep(1200); // well past the idle timeout, the claimer still frozen
  const other = new pg.Client({ connectionString: url });
  await other.connect();
  let retry;
  try {
    retry = await new idem.Fence(k, token(), fp("fp"), 60_000, { layout: "partitioned" }).claim(other);
  } finally {
    await other.end();
  }
  const error = await claiming;
  await conn.end().catch(() => undefined);
  return { retry, error };
}

test("partitioned: a frozen claimer holds the gate no longer than its idle timeout", async () => {
  const { retry, error } = await frozenClaimer("lease");
  assert.deepEqual(retry, PROCEED, "the frozen claimer still held the gate");
  assert.ok(error instanceof idem.PostgresError, "Postgres ended the frozen claimer's session");
});

test("partitioned, teeth: without the idle timeout the frozen claimer keeps the key", async () => {
  const { retry } = await frozenClaimer(null);
  assert.deepEqual(retry, IN_FLIGHT);
});

// ---------------------------------------------------------------- pipelining

/** A TCP proxy to the test database's Postgres that delays what the server sends by `delayMs` and logs both directions in order. */
async function delayingProxy(url, delayMs) {
  const { createServer, connect } = await import("node:net");
  const target = new URL(url);
  const events = [];
  const sockets = new Set();
  const server = createServer((client) => {
    const upstream = connect(Number(target.port || 5432), target.hostname);
    for (const s of [client, upstream]) {
      s.setNoDelay(true); // Nagle would hold a second small write back until the first is acknowledged
      sockets.add(s);
      s.on("error", () => undefined);
      s.on("close", () => sockets.delete(s));
    }
    client.on("data", (chunk) => {
      events.push({ from: "client", bytes: chunk, at: performance.now() });
      upstream.write(chunk);
    });
    upstream.on("data", (chunk) => {
      setTimeout(() => {
        events.push({ from: "server", bytes: chunk, at: performance.now() });
        if (!client.destroyed) client.write(chunk);
      }, delayMs);
    });
    client.on("close", () => upstream.destroy());
    upstream.on("close", () => client.destroy());
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const proxied = new URL(url);
  proxied.hostname = "127.0.0.1";
  proxied.port = String(server.address().port);
  return {
    url: proxied.toString(),
    events,
    /** How many server chunks reached the client between the client's chunks holding `first` and `second`. */
    answersBetween(first, second) {
      const at = (text) => events.findIndex((e) => e.from === "client" && e.bytes.includes(text));
      const [i, j] = [at(first), at(second)];
      assert.ok(i >= 0 && j >= i, `both sent, in order (${i}, ${j})`);
      return events.slice(i, j).filter((e) => e.from === "server").length;
    },
    async close() {
      for (const s of sockets) s.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

const COMPLETE_TEXT = "status = 'completed'";
const COMMIT_TEXT = "COMMIT";

/** Claims a new key directly, pays and commits it through the proxy on a client of a pool made with `pipeline`; the time commit took. */
async function commitThrough(proxy, pipeline) {
  const pool = dbs.unpartitioned.pool();
  const k = key();
  const holder = new idem.Fence(k, token(), fp("fp"), 60_000);
  assert.deepEqual(await holder.claim(pool), PROCEED);
  const proxied = new pg.Pool({ connectionString: proxy.url, max: 1, pipeline });
  proxied.on("error", () => undefined);
  try {
    const conn = await proxied.connect();
    try {
      assert.equal(conn.pipeline, pipeline);
      await conn.query("BEGIN");
      await pay(conn, k);
      const started = performance.now();
      assert.deepEqual(await holder.commit(conn, CREATED), COMMITTED);
      const took = performance.now() - started;
      assert.equal(conn.getTransactionStatus(), "I");
      return took;
    } finally {
      conn.release();
    }
  } finally {
    await proxied.end();
    assert.equal(await payments(pool, k), 1);
  }
}

test("commit: the completion and COMMIT go out in one round trip on a pipelined client, one after the other otherwise", async (t) => {
  const delayMs = 30;
  const proxy = await delayingProxy(dbs.unpartitioned.url, delayMs);
  try {
    const times = { pipelined: [], sequential: [] };
    for (let i = 0; i < 5; i++) {
      proxy.events.length = 0;
      times.pipelined.push(await commitThrough(proxy, true));
      assert.equal(proxy.answersBetween(COMPLETE_TEXT, COMMIT_TEXT), 0, "COMMIT sent before any answer to the completion");
      proxy.events.length = 0;
      times.sequential.push(await commitThrough(proxy, false));
      assert.ok(proxy.answersBetween(COMPLETE_TEXT, COMMIT_TEXT) >= 1, "COMMIT sent after the completion's answer");
    }
    const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
    // Each round trip waits out the proxy's delay at least once.
    assert.ok(Math.min(...times.sequential) >= 2 * delayMs, JSON.stringify(times));
    t.diagnostic(`commit with ${delayMs} ms added per server answer, median of 5: pipelined ${median(times.pipelined).toFixed(1)} ms, one at a time ${median(times.sequential).toFixed(1)} ms`);
  } finally {
    await proxy.close();
  }
});

/** The session state of `conn`'s backend as another connection sees it ('idle': outside any transaction). */
async function sessionState(pool, conn) {
  const { rows } = await pool.query("SELECT state FROM pg_stat_activity WHERE pid = $1", [conn.processID]);
  return rows[0]?.state ?? null;
}

for (const pipeline of [true, false]) {
  const path = pipeline ? "pipelined" : "plain";

  test(`${path}: a lost commit commits nothing and leaves the session outside any transaction`, async () => {
    const pool = dbs.unpartitioned.pool();
    const client = dbs.unpartitioned.pool(1, { pipeline });
    const k = key();
    const slow = new idem.Fence(k, token(), fp("fp"), 60_000, { leaseMs: 300, idleTimeoutMs: 10_000 });
    assert.deepEqual(await slow.claim(pool), PROCEED);
    await sleep(400);
    const retry = new idem.Fence(k, token(), fp("fp"), 60_000, { leaseMs: 30_000 });
    assert.deepEqual(await retry.claim(pool), PROCEED);
    const answer = idem.storedResponse(201, "retry");
    const conn = await client.connect();
    try {
      assert.equal(conn.pipeline, pipeline);
      // Lost to a live claim, then to the retry's completed row.
      for (const [expected, then] of [[IN_FLIGHT, () => retry], [{ kind: "replay", response: answer }, null]]) {
        await conn.query("BEGIN");
        await pay(conn, k);
        assert.deepEqual(await slow.commit(conn, CREATED), { kind: "lost", claim: expected });
        assert.equal(conn.getTransactionStatus(), "I", "node-postgres: outside any transaction");
        assert.equal(await sessionState(pool, conn), "idle", "the server: outside any transaction");
        assert.equal(await payments(pool, k), 0, "the lost holder's payment rolled back");
        if (then !== null) {
          await inTransaction(pool, async (c) => assert.deepEqual(await then().commit(c, answer), COMMITTED));
        }
      }
      assert.deepEqual(await keyRow(pool, k), ["completed", retry.token.toString()]);
      // The session still works: a held commit on it commits.
      const next = key();
      const holder = new idem.Fence(next, token(), fp("fp"), 60_000);
      assert.deepEqual(await holder.claim(pool), PROCEED);
      await conn.query("BEGIN");
      await pay(conn, next);
      assert.deepEqual(await holder.commit(conn, CREATED), COMMITTED);
      assert.equal(await sessionState(pool, conn), "idle");
      assert.equal(await payments(pool, next), 1);
    } finally {
      conn.release();
    }
  });

  test(`${path}: a completion whose gate cannot be taken in time fails commit with its error, commits nothing and ends the transaction`, async () => {
    const pool = dbs.unpartitioned.pool();
    const client = dbs.unpartitioned.pool(1, { pipeline });
    const k = key();
    const holder = new idem.Fence(k, token(), fp("fp"), 60_000, { idleTimeoutMs: 200 });
    assert.deepEqual(await holder.claim(pool), PROCEED);
    // Another transaction holds the key's gate.
    const blocker = await pool.connect();
    try {
      await blocker.query("BEGIN");
      await blocker.query(`SELECT pg_advisory_xact_lock(hashtextextended($1, ${loadSpecLockSeed()}))`, [k]);
      const conn = await client.connect();
      try {
        await conn.query("BEGIN");
        await pay(conn, k);
        const err = await holder.commit(conn, CREATED).then(() => null, (e) => e);
        assert.ok(err instanceof idem.PostgresError, String(err));
        assert.equal(err.cause?.code, "55P03", `the completion's lock timeout: ${err.message}`);
        assert.equal(await sessionState(pool, conn), "idle", "the transaction ended");
      } finally {
        conn.release();
      }
    } finally {
      await blocker.query("ROLLBACK");
      blocker.release();
    }
    assert.deepEqual(await keyRow(pool, k), ["in_progress", holder.token.toString()], "nothing written");
    assert.equal(await payments(pool, k), 0);
  });

  test(`${path}: a response node-postgres cannot encode fails commit with a TypeError before anything is sent, and commits nothing`, async () => {
    const pool = dbs.unpartitioned.pool();
    const client = dbs.unpartitioned.pool(1, { pipeline });
    const k = key();
    const holder = new idem.Fence(k, token(), fp("fp"), 60_000);
    assert.deepEqual(await holder.claim(pool), PROCEED);
    const conn = await client.connect();
    try {
      for (const bad of [
        { status: 201, body: { amount: 10n }, headers: [] }, // JSON.stringify of a BigInt throws in node-postgres' Bind
        { status: 201.5, body: Buffer.from("x"), headers: [] },
        { status: 201, body: Buffer.from("x"), headers: [["x-amount", 10n]] },
      ]) {
        await conn.query("BEGIN");
        await pay(conn, k);
        await assert.rejects(holder.commit(conn, bad), (err) => err instanceof TypeError && /the response's (body|status|header)/.test(err.message));
        assert.equal(conn.getTransactionStatus(), "I", "node-postgres: outside any transaction");
        assert.equal(await sessionState(pool, conn), "idle", "the server: outside any transaction");
        assert.equal(await payments(pool, k), 0, "the effect rolled back");
        assert.deepEqual(await keyRow(pool, k), ["in_progress", holder.token.toString()], "the claim as it was");
      }
      // A Uint8Array body is bytes too.
      await conn.query("BEGIN");
      await pay(conn, k);
      assert.deepEqual(await holder.commit(conn, { status: 201, body: new Uint8Array([111, 107]), headers: [] }), COMMITTED);
      assert.equal(await payments(pool, k), 1);
    } finally {
      conn.release();
    }
  });

  test(`${path}: on the partitioned layout, a takeover that moves the row while the completion waits for the gate makes commit Lost`, async () => {
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
      const conn = await pool.connect();
      try {
        assert.equal(conn.pipeline, pipeline);
        await conn.query("BEGIN");
        await pay(conn, k);
        await taker.query("BEGIN");
        const takeover = new idem.Fence(k, token(), fp("fp"), 2 * 86_400_000, { layout: "partitioned" });
        assert.deepEqual(await takeover.claimIn(taker), PROCEED);
        const pending = holder.commit(conn, CREATED).then((r) => r, (e) => e);
        await sleep(500); // the completion waits for the takeover's gate
        await taker.query("COMMIT");
        assert.deepEqual(await pending, { kind: "lost", claim: IN_FLIGHT });
        assert.equal(conn.getTransactionStatus(), "I");
      } finally {
        conn.release();
      }
      assert.equal(await payments(setup, k), 0, "the lost holder's payment rolled back");
      const { rows } = await setup.query(
        "SELECT status, token::text AS token, tableoid::regclass::text AS part FROM idempotency_keys WHERE key = $1",
        [k],
      );
      assert.equal(rows.length, 1);
      assert.equal(rows[0].status, "in_progress");
      assert.notEqual(rows[0].token, holder.token.toString());
    } finally {
      await taker.end();
      await pool.end();
    }
  });
}

test("pipelined: a completion node-postgres fails to send (its Bind throws) is followed by ROLLBACK, never COMMIT", async () => {
  const pool = dbs.unpartitioned.pool();
  const client = dbs.unpartitioned.pool(1, { pipeline: true });
  const k = key();
  const holder = new idem.Fence(k, token(), fp("fp"), 60_000);
  assert.deepEqual(await holder.claim(pool), PROCEED);
  const conn = await client.connect();
  const connection = conn.connection;
  const bind = connection.bind;
  try {
    await conn.query("BEGIN");
    await pay(conn, k);
    // An encoding failure past the fence's own checks: node-postgres sends Close and Sync and fails the query at once.
    connection.bind = function (config) {
      if (config.values?.[0] === k) throw new Error("cannot encode this parameter");
      return bind.call(this, config);
    };
    await assert.rejects(holder.commit(conn, CREATED), (err) => err instanceof idem.PostgresError && /cannot encode/.test(err.message));
    connection.bind = bind;
    assert.equal(conn.getTransactionStatus(), "I");
    assert.equal(await sessionState(pool, conn), "idle");
    assert.equal(await payments(pool, k), 0, "no COMMIT went behind the unsent completion");
    assert.deepEqual(await keyRow(pool, k), ["in_progress", holder.token.toString()]);
  } finally {
    connection.bind = bind;
    conn.release();
  }
});

test("hold: renews the lease and holds the key's gate until the phase's transaction ends; lost, it answers what the key holds", async () => {
  const pool = dbs.unpartitioned.pool();
  const k = key();
  const holder = new idem.Fence(k, token(), fp("fp"), 60_000, { leaseMs: 300, idleTimeoutMs: 5000 });
  assert.deepEqual(await holder.claim(pool), PROCEED);
  const conn = await pool.connect();
  try {
    await conn.query("BEGIN");
    assert.deepEqual(await holder.hold(conn), { kind: "held" });
    const { rows } = await conn.query("SELECT current_setting('idle_in_transaction_session_timeout') AS idle, current_setting('lock_timeout') AS lock");
    assert.deepEqual(rows[0], { idle: "5s", lock: "5s" }, "the fence's idle timeout, for this transaction");
    await pay(conn, k);
    await sleep(450); // past the renewed lease: only the gate keeps a retry out now
    // Without the gate the claim would wait for the row the renewal locked: bounded, so that fails rather than hangs.
    const claim = new idem.Fence(k, token(), fp("fp"), 60_000).claim(pool);
    const answered = await Promise.race([claim, sleep(2000).then(() => "no answer within 2 s")]);
    assert.deepEqual(answered, IN_FLIGHT, "the phase's transaction holds the gate");
    await conn.query("COMMIT");
    assert.equal(await payments(pool, k), 1, "the phase's effect");
  } finally {
    conn.release(true); // destroyed: a failed check leaves no transaction open
  }
  // The transaction ended and the lease lapsed: a retry takes over, and the holder's next phase is lost.
  const retry = new idem.Fence(k, token(), fp("fp"), 60_000, { leaseMs: 30_000 });
  assert.deepEqual(await retry.claim(pool), PROCEED);
  await inTransaction(pool, async (c) => {
    assert.deepEqual(await holder.hold(c), { kind: "lost", claim: IN_FLIGHT });
  });
  await inTransaction(pool, async (c) => {
    assert.deepEqual(await retry.hold(c), { kind: "held" });
    assert.deepEqual(await retry.commit(c, CREATED), COMMITTED);
  });
  await inTransaction(pool, async (c) => {
    assert.deepEqual(await holder.hold(c), { kind: "lost", claim: { kind: "replay", response: CREATED } });
  });
});

function loadSpecLockSeed() {
  return Number(idem.spec.fence().lock_seed);
}

// ------------------------------------------------- the caller's transaction

/** The key's row as the test sees it: [status, token] or null. */
async function keyRow(pool, k) {
  const { rows } = await pool.query("SELECT status, token::text AS token FROM idempotency_keys WHERE key = $1", [k]);
  return rows.length === 0 ? null : [rows[0].status, rows[0].token];
}

for (const layout of ["unpartitioned", "partitioned"]) {
  const fence = (k, t, f, options = {}) => new idem.Fence(k, t, fp(f), 60_000, { layout, ...options });

  test(`${layout}: complete, commit, hold and claimIn refuse a client outside a transaction and write nothing`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const t = token();
    const holder = fence(k, t, "fp", { leaseMs: 30_000 });
    assert.deepEqual(await holder.claim(pool), PROCEED);
    const conn = await pool.connect();
    try {
      const notInTransaction = (err) => err instanceof idem.PostgresError && /inside the caller's transaction/.test(err.message) && /status I/.test(err.message);
      await assert.rejects(holder.complete(conn, CREATED), notInTransaction);
      await assert.rejects(holder.commit(conn, CREATED), notInTransaction);
      await assert.rejects(holder.hold(conn), notInTransaction);
      const other = key();
      await assert.rejects(fence(other, token(), "fp").claimIn(conn), notInTransaction);
      assert.equal(conn.getTransactionStatus(), "I", "no transaction left open");
      assert.equal(await keyRow(pool, other), null, "claimIn claimed nothing");
      // An aborted transaction is refused too (its statements would fail anyway).
      await conn.query("BEGIN");
      await conn.query("SELECT 1/0").catch(() => undefined);
      // pg rejects on the ErrorResponse, before it reads the ReadyForQuery
      // that sets the status to E: let it read that first.
      while (conn.getTransactionStatus() !== "E") await new Promise((resolve) => setImmediate(resolve));
      await assert.rejects(holder.complete(conn, CREATED), (err) => err instanceof idem.PostgresError && /status E/.test(err.message));
      await conn.query("ROLLBACK");
    } finally {
      conn.release();
    }
    assert.deepEqual(await keyRow(pool, k), ["in_progress", t.toString()], "the claim neither completed nor renewed");
  });

  test(`${layout}: a durable claim refuses a client inside a transaction and leaves that transaction as it was`, async () => {
    const pool = dbs[layout].pool();
    const k = key();
    const conn = await pool.connect();
    try {
      await conn.query("BEGIN");
      await pay(conn, k);
      await assert.rejects(
        fence(k, token(), "fp").claim(conn),
        (err) => err instanceof idem.PostgresError && /outside any transaction/.test(err.message) && /status T/.test(err.message),
      );
      assert.equal(conn.getTransactionStatus(), "T", "the caller's transaction is still open");
      await conn.query("ROLLBACK");
    } finally {
      conn.release();
    }
    assert.equal(await payments(pool, k), 0, "the caller's rollback undid its payment");
    assert.equal(await keyRow(pool, k), null, "nothing claimed");
  });
}
