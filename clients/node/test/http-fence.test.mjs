// The fence handed to the handler by the Express middleware and the Fastify
// plugin: a committed payment is stored MIRRORED and replayed; a claim not
// committed releases Redis and the claim; after Redis forgets, the retry's
// claim finds the committed row and the fence's replay refills Redis; a
// holder that lost its key commits nothing and answers what the key holds.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import * as idem from "../dist/index.js";
import { startRedis, database, loadSpec, sleep } from "./helpers.mjs";
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
});

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
