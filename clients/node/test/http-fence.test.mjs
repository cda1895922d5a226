// The fence handed to the handler by the Express middleware and the Fastify
// plugin: a committed payment is stored MIRRORED and replayed; a claim not
// committed releases Redis and the claim; after Redis forgets, the retry's
// claim finds the committed row and the fence's replay refills Redis; a
// holder that lost its key commits nothing and answers what the key holds.
// claimUpFront: the fence's claim, made by the middleware before the handler
// runs, answers replay, 422 and 409 with the handler not run; the committed
// row holds Redis' token; an unused claim, and the claim of a handler that
// fails, are released; a claim with no answer in time is 503 and released
// once it commits.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import * as idem from "../dist/index.js";
import { startRedis, database, emptyDatabase, loadSpec, sleep } from "./helpers.mjs";
import { FRAMEWORKS, request } from "./apps.mjs";

const HTTP = loadSpec("http.json");
const quiet = { warn: () => undefined, error: () => undefined };
let server;
let client;
let db;
let pool;
let n = 0;
const newKey = () => `f-${process.pid}-${Date.now()}-${n++}`;
const rkey = (k) => idem.redisKey(HTTP.defaults.key_prefix, "", k);

before(async () => {
  server = await startRedis();
  client = await idem.IdemClient.connect(server.url);
  db = await database();
  pool = db.pool(8);
});
after(() => client.close());

async function payments(k) {
  const { rows } = await pool.query("SELECT count(*)::int AS n FROM payments WHERE key = $1", [k]);
  return rows[0].n;
}

/** POST /pay: claim, "charge", then the payment and the key's row in one transaction. ?fail=1 fails after the claim; ?ms= delays the key's first charge. */
const payRoute = (calls) => ({
  "/pay": async (ctx) => {
    calls.hit(`pay:${ctx.key}`);
    const fence = ctx.idem.fence;
    const claim = await fence.claim(pool);
    if (claim.kind !== "proceed") return { status: 299, headers: {}, body: `claim ${claim.kind}` };
    if (calls.hit(`charge:${ctx.key}`) === 1) await sleep(Number(ctx.query.get("ms") ?? 0));
    if (ctx.query.get("fail") === "1") return { status: 500, headers: {}, body: "processor down" };
    const answer = idem.storedResponse(201, JSON.stringify({ paid: ctx.key, attempt: calls.of(`charge:${ctx.key}`) }), [["content-type", "application/json"]]);
    const conn = await pool.connect();
    try {
      await conn.query("BEGIN");
      await conn.query("INSERT INTO payments (key, amount) VALUES ($1, 1)", [ctx.key]);
      const done = await fence.commit(conn, answer);
      if (done.kind === "lost") return { status: 298, headers: {}, body: "lost" };
    } finally {
      conn.release();
    }
    return { status: answer.status, headers: { "content-type": "application/json" }, body: answer.body };
  },
  /** Claims, then answers 5000 bytes whatever the claim found (a handler that ignores its fence's answer). */
  "/claim-big": async (ctx) => {
    const claim = await ctx.idem.fence.claim(pool);
    calls.hit(`claim-big:${claim.kind}:${ctx.key}`);
    return { status: 200, headers: { "content-type": "text/plain" }, body: "b".repeat(5000) };
  },
  /** Takes over the claim made up front (through a source that is no pool or client: a statement would fail), then throws. */
  "/claim-boom": async (ctx) => {
    const claim = await ctx.idem.fence.claim({}).catch(() => ({ kind: "a statement ran" }));
    calls.hit(`claim-boom:${claim.kind}:${ctx.key}`);
    throw new Error("the handler failed after its claim");
  },
});

/** The key's row: [status, token] or null. */
async function row(k) {
  const { rows } = await pool.query({ text: "SELECT status, token FROM idempotency_keys WHERE key = $1", values: [rkey(k)], rowMode: "array" });
  return rows[0] === undefined ? null : [rows[0][0], BigInt(rows[0][1])];
}

for (const [framework, makeApp] of Object.entries(FRAMEWORKS)) {
  const withApp = async (options, f) => {
    const app = await makeApp({ client, logger: quiet, ...options }, payRoute);
    try {
      await f(app);
    } finally {
      await app.close();
    }
  };
  const pay = (app, k, query = "") => request(app.url, { path: `/pay${query}`, headers: [["idempotency-key", k]] });

  test(`${framework}: a committed payment is stored MIRRORED and replayed`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      const first = await pay(app, k);
      assert.equal(first.status, 201, first.text);
      assert.equal((await client.get(rkey(k))).mirror, "mirrored", "the row committed with the payment is the record");
      const again = await pay(app, k);
      assert.equal(again.text, first.text);
      assert.equal(again.headers["idempotent-replayed"], "true");
      assert.equal(await payments(`/${k}`), 1);
    }));

  test(`${framework}: a claim that is not committed releases Redis and the durable claim; the retry runs at once`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      assert.equal((await pay(app, k, "?fail=1")).status, 500);
      const { rows } = await pool.query("SELECT count(*)::int AS n FROM idempotency_keys WHERE key = $1", [rkey(k)]);
      assert.equal(rows[0].n, 0, "the durable claim was released");
      assert.equal(await client.get(rkey(k)), null, "the Redis key was released");
      const retry = await pay(app, k, "?fail=1");
      assert.equal(retry.status, 500);
      assert.equal(app.calls.of(`charge:/${k}`), 2);
    }));

  test(`${framework}: after Redis forgets, the retry's claim finds the committed row; the fence's replay refills Redis`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      const first = await pay(app, k);
      const raw = await server.raw();
      await raw.del(rkey(k));
      const again = await pay(app, k);
      assert.equal(again.status, 201);
      assert.equal(again.text, first.text);
      assert.equal(again.headers["idempotent-replayed"], "true");
      assert.equal(app.calls.of(`charge:/${k}`), 1, "charged once");
      assert.equal(await payments(`/${k}`), 1);
      assert.equal((await client.get(rkey(k))).state, "completed", "Redis refilled");
    }));

  test(`${framework}: a live durable claim is 409 when Redis forgot the key`, () =>
    withApp({ leaseMs: 5000 }, async (app) => {
      const k = newKey();
      const slow = pay(app, k, "?ms=800");
      await sleep(300);
      const raw = await server.raw();
      await raw.del(rkey(k));
      const dup = await pay(app, k, "?ms=800");
      assert.equal(dup.status, 409, dup.text);
      assert.equal(dup.headers["retry-after"], String(Math.ceil(HTTP.defaults.fence_retry_after_ms / 1000)));
      assert.equal((await slow).status, 201);
      assert.equal(app.calls.of(`charge:/${k}`), 1);
      assert.equal(await payments(`/${k}`), 1);
    }));

  test(`${framework}: a holder that lost its key commits nothing and answers what the key holds`, () =>
    withApp({ leaseMs: 300 }, async (app) => {
      const k = newKey();
      const raw = await server.raw();
      // The first holder stops renewing (Redis forgets the key), its fence lease lapses, a retry takes over.
      const slow = pay(app, k, "?ms=900");
      await sleep(150);
      await raw.del(rkey(k));
      await sleep(300);
      const retry = await pay(app, k, "?ms=900");
      assert.equal(retry.status, 201, retry.text);
      const late = await slow;
      assert.equal(late.status, 201);
      assert.equal(late.text, retry.text, "the lost holder answers the retry's payment");
      assert.equal(late.headers["idempotent-replayed"], "true");
      assert.equal(await payments(`/${k}`), 1, "one payment");
    }));
}

test("claimUpFront needs readThrough", () => {
  assert.throws(() => new idem.Idempotency({ client, claimUpFront: true }), /claimUpFront needs readThrough/);
});

for (const [framework, makeApp] of Object.entries(FRAMEWORKS)) {
  const withApp = async (options, f) => {
    const app = await makeApp({ client, logger: quiet, readThrough: new idem.ReadThrough(pool), claimUpFront: true, ...options }, payRoute);
    try {
      await f(app);
    } finally {
      await app.close();
    }
  };
  const post = (app, path, k, body = "x") => request(app.url, { path, headers: [["idempotency-key", k]], body });

  test(`${framework}: claimUpFront answers what the fence finds before the handler runs`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      const first = await post(app, "/pay", k);
      assert.equal(first.status, 201, first.text);
      assert.equal(app.calls.of(`pay:/${k}`), 1);
      const record = await client.get(rkey(k));
      assert.deepEqual(await row(k), ["completed", record.token], "the handler committed the claim made up front with Redis' token");
      assert.equal(record.mirror, "mirrored");
      // Redis forgets: the claim finds the row, replays it and refills Redis; the handler does not run.
      const raw = await server.raw();
      await raw.del(rkey(k));
      const again = await post(app, "/pay", k);
      assert.equal(again.status, 201, again.text);
      assert.equal(again.headers["idempotent-replayed"], "true");
      assert.equal(again.text, first.text);
      assert.equal(app.calls.of(`pay:/${k}`), 1, "the handler did not run for the replay");
      const refilled = await client.get(rkey(k));
      assert.equal(refilled.state, "completed");
      assert.equal(refilled.mirror, "mirrored", "Redis refilled from the row");
      // Another request under the key: 422 from the row, the Redis key released.
      await raw.del(rkey(k));
      const other = await post(app, "/pay", k, "y");
      assert.equal(other.status, 422, other.text);
      assert.equal(app.calls.of(`pay:/${k}`), 1, "the handler did not run for the mismatch");
      assert.equal(await client.get(rkey(k)), null, "released");
      // A live claim of this request (Redis forgot while its holder runs): 409, Retry-After 1, released.
      const live = newKey();
      const same = app.flow.fingerprinter.fingerprint("POST", "/pay", [], Buffer.from("x"));
      const holder = new idem.Fence(rkey(live), 1n, same, 60_000, { leaseMs: 30_000 });
      assert.deepEqual(await holder.claim(pool), { kind: "proceed" });
      const busy = await post(app, "/pay", live);
      assert.equal(busy.status, 409, busy.text);
      assert.equal(busy.headers["retry-after"], String(Math.ceil(HTTP.defaults.fence_retry_after_ms / 1000)));
      assert.equal(app.calls.of(`pay:/${live}`), 0, "the handler did not run for the live claim");
      assert.equal(await client.get(rkey(live)), null, "released");
      assert.deepEqual(await row(live), ["in_progress", 1n], "the live claim is left to its holder");
      await holder.release(pool);
      assert.equal(await payments(`/${k}`), 1);
    }));

  test(`${framework}: a claim made up front that the handler does not use is released; its response is stored as usual`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      const first = await post(app, "/echo", k);
      assert.equal(first.status, 201);
      assert.equal(await row(k), null, "the unused claim was given up");
      const record = await client.get(rkey(k));
      assert.equal(record.state, "completed");
      assert.equal(record.mirror, "pending", "stored as the handler's response, for the writer to mirror");
      const again = await post(app, "/echo", k);
      assert.equal(again.headers["idempotent-replayed"], "true");
      assert.equal(app.calls.of(`echo:/${k}`), 1);
    }));

  test(`${framework}: a handler that fails after the claim made up front, or before using it, leaves no claim behind`, () =>
    withApp({}, async (app) => {
      // Fails with a 5xx after taking the claim over: the claim and the key released; the retry runs at once.
      const k = newKey();
      assert.equal((await post(app, "/pay?fail=1", k)).status, 500);
      assert.equal(await row(k), null, "the claim was released");
      assert.equal(await client.get(rkey(k)), null);
      assert.equal((await post(app, "/pay?fail=1", k)).status, 500, "the retry ran (not 409 until the lease lapses)");
      assert.equal(app.calls.of(`charge:/${k}`), 2);
      // Throws after taking the claim over.
      const thrown = newKey();
      assert.equal((await post(app, "/claim-boom", thrown)).status, 500);
      assert.equal(app.calls.of(`claim-boom:proceed:/${thrown}`), 1, "the claim made up front, taken over with no statement");
      assert.equal(await row(thrown), null, "the claim was released");
      assert.equal(await client.get(rkey(thrown)), null);
      assert.equal((await post(app, "/claim-boom", thrown)).status, 500);
      assert.equal(app.calls.of(`claim-boom:proceed:/${thrown}`), 2);
      // Throws before it used the fence.
      const early = newKey();
      assert.equal((await post(app, "/boom", early)).status, 500);
      assert.equal(await row(early), null, "the claim was released");
      assert.equal(await client.get(rkey(early)), null);
    }));

  test(`${framework}: a claim with no answer within read-through's timeout is 503, the key released, and the claim released once made`, () =>
    withApp({ readThrough: new idem.ReadThrough(pool, { timeoutMs: 300 }) }, async (app) => {
      const k = newKey();
      // An expired row the claim takes over, locked by another transaction: the claim waits for it.
      await pool.query(
        `INSERT INTO idempotency_keys (key, fingerprint, status, token, created_at, expires_at, lease_expires_at)
         VALUES ($1, repeat('ab', 32), 'in_progress', 1, now() - interval '2 days', now() - interval '1 day', now() - interval '1 day')`,
        [rkey(k)],
      );
      const locker = await pool.connect();
      try {
        await locker.query("BEGIN");
        await locker.query("SELECT 1 FROM idempotency_keys WHERE key = $1 FOR UPDATE", [rkey(k)]);
        const answer = await post(app, "/pay", k);
        assert.equal(answer.status, 503, answer.text);
        assert.equal(app.calls.of(`pay:/${k}`), 0);
        assert.equal(await client.get(rkey(k)), null, "the Redis key released");
      } finally {
        await locker.query("ROLLBACK").catch(() => undefined);
        locker.release();
      }
      // The claim commits once the lock is gone, and is then released in the background.
      await app.flow.drain();
      assert.equal(await row(k), null, "the late claim was released");
      const retry = await post(app, "/pay", k);
      assert.equal(retry.status, 201, retry.text);
    }));
}

for (const [framework, makeApp] of Object.entries(FRAMEWORKS)) {
  test(`${framework}: with failOpen, a claim made up front that Postgres refuses is 503, never a handler run without its fence`, async () => {
    // A database without idempotency_keys: Postgres answers, and refuses the claim (42P01).
    const empty = (await emptyDatabase()).pool(2);
    const app = await makeApp({ client, logger: quiet, failOpen: true, readThrough: new idem.ReadThrough(empty), claimUpFront: true }, payRoute);
    try {
      const k = newKey();
      for (let i = 0; i < 2; i++) {
        const answer = await request(app.url, { path: "/pay", headers: [["idempotency-key", k]], body: "x" });
        assert.equal(answer.status, 503, answer.text);
        assert.equal(answer.headers["retry-after"], "1");
      }
      assert.equal(app.calls.of(`pay:/${k}`), 0, "the handler never ran");
      assert.equal(await client.get(rkey(k)), null, "the Redis key released");
    } finally {
      await app.close();
    }
  });
}

for (const [framework, makeApp] of Object.entries(FRAMEWORKS)) {
  test(`${framework}: a response over maxResponseBody after the fence answered in_flight is the fence's 409, not the handler's body`, async () => {
    const app = await makeApp({ client, logger: quiet, maxResponseBody: 1000 }, payRoute);
    try {
      const k = newKey();
      // Another holder's live claim (Redis forgot it): the handler's claim finds it in flight.
      const same = app.flow.fingerprinter.fingerprint("POST", "/claim-big", [], Buffer.from("x"));
      const holder = new idem.Fence(rkey(k), 1n, same, 60_000, { leaseMs: 30_000 });
      assert.deepEqual(await holder.claim(pool), { kind: "proceed" });
      const answer = await request(app.url, { path: "/claim-big", headers: [["idempotency-key", k]], body: "x" });
      assert.equal(answer.status, 409, `${answer.status} with ${answer.body.length} bytes`);
      assert.equal(answer.headers["retry-after"], String(Math.ceil(HTTP.defaults.fence_retry_after_ms / 1000)));
      assert.equal(app.calls.of(`claim-big:in_flight:/${k}`), 1);
      assert.equal(await client.get(rkey(k)), null, "the Redis key released");
      assert.deepEqual(await row(k), ["in_progress", 1n], "the live claim is left to its holder");
      await holder.release(pool);
    } finally {
      await app.close();
    }
  });
}
