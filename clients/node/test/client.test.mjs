// IdemClient against a real redis-server, once with the idem module and once
// as a managed service runs it (no module, MODULE renamed away: the client
// loads the Functions library): the four outcomes, COMPLETE/ABORT/TOUCH/GET,
// waiting for the holder's answer (WAIT on the module, polling on the
// library), lease takeover and fencing, the module's error codes as typed
// errors, PACKED fallback, and a server that is down answering
// UnavailableError.
import { test, describe, before } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import * as idem from "../dist/index.js";
import { startServer, key, sleep, SERVER_KINDS } from "./helpers.mjs";

const fp = (s) => createHash("sha256").update(s).digest();
const ttlMs = 60_000;
const BACKEND = { module: "module", managed: "functions" };

for (const kind of SERVER_KINDS) describe(`${kind} server`, () => {
  let server;
  let client;
  const startRedis = () => startServer(kind);

  before(async () => {
    server = await startRedis();
    client = await idem.IdemClient.connect(server.url);
  });

  test("auto picks the server's backend", () => {
    assert.equal(client.backend, BACKEND[kind]);
  });

  test("the four outcomes, and the record IDEM.GET shows", async (t) => {
    t.after(() => undefined);
    const k = key();
    const first = await client.begin(k, fp("a"), { ttlMs, leaseMs: 5000 });
    assert.equal(first.kind, "new");
    assert.ok(first.token > 0n);
    const progress = await client.get(k);
    assert.equal(progress.state, "in_progress");
    assert.equal(progress.token, first.token);
    assert.equal(progress.fingerprintHex, idem.storedHex(fp("a")));
    const dup = await client.begin(k, fp("a"), { ttlMs });
    assert.equal(dup.kind, "in_flight");
    assert.ok(dup.retryAfterMs > 0 && dup.retryAfterMs <= 5000);
    assert.deepEqual(await client.begin(k, fp("b"), { ttlMs }), { kind: "mismatch" });
    const response = idem.storedResponse(201, '{"id":1}', [["content-type", "application/json"], ["x-twice", "1"], ["x-twice", "2"]]);
    await client.complete(k, first.token, response);
    assert.deepEqual(await client.begin(k, fp("a"), { ttlMs }), { kind: "replay", response });
    const done = await client.get(k);
    assert.equal(done.state, "completed");
    assert.deepEqual(done.response, response);
    assert.equal(done.mirror, "pending");
    assert.equal(await client.get(key()), null);
  });

  test("the four-field layout when PACKED is off gives the same replay", async () => {
    const plain = new idem.IdemClient(client.redis, { packedReplies: false });
    const k = key();
    const { token } = await plain.begin(k, fp("x"), { ttlMs });
    const response = idem.storedResponse(200, Buffer.from([0, 1, 2, 255]), [["location", "/p/1"]]);
    await plain.complete(k, token, response, "mirror");
    assert.deepEqual(await plain.begin(k, fp("x"), { ttlMs }), { kind: "replay", response });
    assert.equal((await plain.get(k)).mirror, "mirrored");
  });

  test("ABORT releases the key; a second ABORT and a stale COMPLETE say so", async () => {
    const k = key();
    const { token } = await client.begin(k, fp("a"), { ttlMs });
    assert.equal(await client.abort(k, token), true);
    assert.equal(await client.abort(k, token), false);
    const again = await client.begin(k, fp("a"), { ttlMs });
    assert.equal(again.kind, "new");
    await assert.rejects(client.complete(k, token, idem.storedResponse(200)), idem.StaleError);
    await client.complete(k, again.token, idem.storedResponse(200));
    await assert.rejects(client.complete(k, again.token, idem.storedResponse(200)), idem.CompletedError);
    await assert.rejects(client.touch(key(), 5n, 1000), idem.NotFoundError);
  });

  test("a lapsed lease is taken over with a larger token; the old holder is fenced off; TOUCH keeps a lease alive", async () => {
    const k = key();
    const first = await client.begin(k, fp("a"), { ttlMs, leaseMs: 150 });
    const touched = await client.touch(k, first.token, 400);
    assert.ok(touched > 150 && touched <= 400, String(touched));
    await sleep(200);
    assert.equal((await client.begin(k, fp("a"), { ttlMs })).kind, "in_flight");
    await sleep(300);
    const second = await client.begin(k, fp("a"), { ttlMs, leaseMs: 5000 });
    assert.equal(second.kind, "new");
    assert.ok(second.token > first.token);
    await assert.rejects(client.complete(k, first.token, idem.storedResponse(200)), idem.StaleError);
    await assert.rejects(client.touch(k, first.token, 1000), idem.StaleError);
    await client.complete(k, second.token, idem.storedResponse(201, "second"));
  });

  test("waiting: a duplicate waits for the holder's answer without holding up the shared connection", async () => {
    const k = key();
    const { token } = await client.begin(k, fp("a"), { ttlMs, leaseMs: 5000 });
    const waiting = client.begin(k, fp("a"), { ttlMs, waitMs: 3000 });
    await sleep(100);
    // The shared connection is not held up by the waiting BEGIN.
    const t0 = Date.now();
    assert.equal((await client.begin(key(), fp("z"), { ttlMs })).kind, "new");
    assert.ok(Date.now() - t0 < 1000);
    await client.complete(k, token, idem.storedResponse(201, "done"));
    const answer = await waiting;
    assert.equal(answer.kind, "replay");
    assert.equal(answer.response.body.toString(), "done");
    // No answer within the wait: in_flight.
    const k2 = key();
    await client.begin(k2, fp("a"), { ttlMs, leaseMs: 5000 });
    const started = Date.now();
    assert.equal((await client.begin(k2, fp("a"), { ttlMs, waitMs: 200 })).kind, "in_flight");
    assert.ok(Date.now() - started >= 180);
  });

  test("module errors arrive typed: BADARG, WRONGTYPE, TOOLARGE", async () => {
    const raw = await server.raw();
    const k = key();
    await raw.set(k, "plain");
    await assert.rejects(client.begin(k, fp("a"), { ttlMs }), idem.WrongTypeError);
    await assert.rejects(client.get(k), idem.WrongTypeError);
    const bare = ["IDEM.BEGIN", key()];
    const sent = kind === "module" ? bare : idem.translate(client.backend, bare);
    await assert.rejects(client.redis.sendCommand(sent).catch((e) => { throw idem.fromRedis(e); }), idem.BadArgError);
    const big = key();
    const { token } = await client.begin(big, fp("a"), { ttlMs });
    const max = kind === "module" ? Number((await raw.sendCommand(["CONFIG", "GET", "idem.max-body-bytes"]))[1] ?? 1048576) : 1048576;
    await assert.rejects(client.complete(big, token, idem.storedResponse(200, Buffer.alloc(max + 1))), idem.TooLargeError);
  });

  test("OOM: a full Redis refuses a new key with a transient error", async () => {
    const own = await startRedis();
    const c = await idem.IdemClient.connect(own.url);
    const raw = await own.raw();
    await raw.sendCommand(["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    await raw.sendCommand(["CONFIG", "SET", "maxmemory", "1"]);
    const err = await c.begin(key(), fp("a"), { ttlMs }).then(() => null, (e) => e);
    assert.ok(err instanceof idem.OomError, String(err));
    assert.equal(err.isTransient, true);
    assert.equal(err.isUnavailable, false);
    await raw.sendCommand(["CONFIG", "SET", "maxmemory", "0"]);
    await c.close();
  });

  test("a server that is down answers UnavailableError at once; the client reconnects when it is back", async () => {
    const own = await startRedis();
    const c = await idem.IdemClient.connect(own.url, { callTimeoutMs: 500 });
    assert.equal((await c.begin(key(), fp("a"), { ttlMs })).kind, "new");
    await own.stop();
    const t0 = Date.now();
    const err = await c.begin(key(), fp("a"), { ttlMs }).then(() => null, (e) => e);
    assert.ok(err instanceof idem.UnavailableError, String(err));
    assert.ok(err.isUnreachable && err.isTransient);
    assert.ok(Date.now() - t0 < 1500);
    await own.start();
    let outcome = null;
    for (let i = 0; i < 100 && outcome === null; i++) {
      outcome = await c.begin(key(), fp("a"), { ttlMs }).catch(() => null);
      if (outcome === null) await sleep(50);
    }
    assert.equal(outcome?.kind, "new");
    await c.close();
  });

  test("bad input is refused before anything is sent", async () => {
    await assert.rejects(client.abort(key(), 0n), RangeError);
    await assert.rejects(client.complete(key(), 1n << 63n, idem.storedResponse(200)), RangeError);
    await assert.rejects(client.begin(key(), fp("a"), { ttlMs: -1 }), RangeError);
  });

  test("close", async () => {
    await client.close();
  });
});
