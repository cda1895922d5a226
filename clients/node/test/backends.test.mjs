// The backends against real redis-servers without the module (as managed
// services run them): the hash slot and outbox key idem_complete is given,
// the library loaded when missing or older and after FUNCTION FLUSH (the
// call sent once more), the scripts form and SCRIPT FLUSH, the automatic
// choice on a server without FUNCTION, a server with no idem at all reported
// once with what to do, waiting by polling, error replies whose text is not
// UTF-8, and the middleware's core flow on the library.
import { test, before } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { createClient, RESP_TYPES } from "@redis/client";
import * as idem from "../dist/index.js";
import { startManagedRedis, startServer, key, sleep, loadSpec, SERVER_KINDS } from "./helpers.mjs";
import { FRAMEWORKS, request } from "./apps.mjs";

const fp = (s) => createHash("sha256").update(s).digest();
const ttlMs = 60_000;
const FUNCTIONS = loadSpec("functions.json");
const HTTP = loadSpec("http.json");
const LIBRARY_COMMANDS = "+del +exists +hdel +hset +hmget +pexpireat +pexpiretime +pttl +time +zadd +zrem +zscore +type";
let managed;

before(async () => {
  managed = await startManagedRedis();
});

async function plain(url, options = {}) {
  const c = createClient({ url, ...options });
  c.on("error", () => undefined);
  await c.connect();
  return c;
}

test("slots: CRC16-XMODEM as Redis Cluster computes it, hash tags honoured; every outbox tag is in its slot", async () => {
  assert.equal(idem.crc16(Buffer.from("123456789")), 0x31c3);
  assert.equal(idem.slot("foo"), 12182);
  assert.equal(idem.slot("bar"), 5061);
  assert.equal(idem.slot(""), 0);
  assert.equal(idem.slot("{user1000}.following"), idem.slot("user1000"));
  assert.equal(idem.slot("foo{}{bar}"), idem.slot("foo{}{bar}"), "an empty tag hashes the whole key");
  assert.notEqual(idem.slot("foo{}{bar}"), idem.slot("bar"));
  assert.equal(idem.slot("foo{{bar}}zap"), idem.slot("{bar"));
  assert.equal(idem.slot("foo{bar}{zap}"), idem.slot("bar"));
  assert.equal(idem.slot(Buffer.from([0xff, 0x00, 0x7b])), idem.crc16(Buffer.from([0xff, 0x00, 0x7b])) % 16384);
  const slots = loadSpec("outbox_slots.json");
  assert.equal(slots.tags.length, 16384);
  slots.tags.forEach((tag, s) => assert.equal(idem.slot(tag), s, tag));
  // A server with cluster support agrees, and the outbox shares the record's slot.
  const cluster = await startManagedRedis("--cluster-enabled", "yes");
  const raw = await plain(cluster.url);
  try {
    for (const k of ["foo", "idem:{t:abc}", "idem:acme:k-1", "x{}y", "ä€"]) {
      assert.equal(Number(await raw.sendCommand(["CLUSTER", "KEYSLOT", k])), idem.slot(k), k);
      assert.equal(idem.slot(idem.outboxKey(k)), idem.slot(k), k);
      assert.ok(idem.outboxKey(k).startsWith(slots.prefix) && idem.outboxKey(k).endsWith(slots.suffix));
    }
  } finally {
    await raw.close();
  }
});

test("calls as the library takes them: FCALL name numkeys keys args, the outbox as COMPLETE's second key; EVALSHA with the name first", () => {
  const k = "idem:{t:1}";
  assert.deepEqual(idem.translate("functions", ["IDEM.BEGIN", k, "fp", "60", "PACKED"]), ["FCALL", "idem_begin", "1", k, "fp", "60", "PACKED"]);
  assert.deepEqual(idem.translate("functions", ["IDEM.COMPLETE", k, "7", "200", "b"]), [
    "FCALL", "idem_complete", "2", k, idem.outboxKey(k), "7", "200", "b",
  ]);
  assert.deepEqual(idem.translate("scripts", ["IDEM.GET", k]), ["EVALSHA", idem.scriptSha(), "1", k, "idem_get"]);
  for (const f of Object.values(FUNCTIONS.functions).filter((f) => ["IDEM.BEGIN", "IDEM.ABORT", "IDEM.TOUCH", "IDEM.GET"].includes(f.module))) {
    assert.equal(idem.translate("functions", [f.module, k])[1], f.name);
  }
  // The scripts form is the source without its first line.
  const source = idem.spec.librarySource();
  assert.ok(source.startsWith("#!lua"));
  assert.equal(idem.scriptBody(source), source.slice(source.indexOf("\n") + 1));
  assert.equal(idem.scriptSha(), createHash("sha1").update(idem.scriptBody(source)).digest("hex"));
});

test("functions: loaded at start when missing, replaced when older; FUNCTION FLUSH between calls loads it and sends the call once more", async () => {
  const raw = await plain(managed.url);
  try {
    await raw.sendCommand(["FUNCTION", "FLUSH"]);
    // An older library of the same name is replaced.
    await raw.sendCommand(["FUNCTION", "LOAD", "#!lua name=idem\nredis.register_function('idem_version', function() return 0 end)"]);
    const c = await idem.IdemClient.connect(managed.url);
    assert.equal(c.backend, "functions");
    assert.equal(c.libraryLoads, 1);
    assert.equal(Number(await raw.sendCommand(["FCALL", "idem_version", "0"])), FUNCTIONS.version);
    const k = key();
    const first = await c.begin(k, fp("a"), { ttlMs, leaseMs: 5000 });
    assert.equal(first.kind, "new");
    await raw.sendCommand(["FUNCTION", "FLUSH"]);
    const response = idem.storedResponse(201, "done", [["location", "/p/1"]]);
    await c.complete(k, first.token, response);
    assert.equal(c.libraryLoads, 2);
    await raw.sendCommand(["FUNCTION", "FLUSH"]);
    assert.deepEqual(await c.begin(k, fp("a"), { ttlMs }), { kind: "replay", response });
    assert.equal(c.libraryLoads, 3);
    // Many calls that find the library gone at once load it once.
    await raw.sendCommand(["FUNCTION", "FLUSH"]);
    const all = await Promise.all(Array.from({ length: 20 }, () => c.get(k)));
    assert.ok(all.every((r) => r.state === "completed"));
    assert.equal(c.libraryLoads, 4);
    // A library it cannot load again is a NoBackendError, not a retry loop.
    await raw.sendCommand(["FUNCTION", "FLUSH"]);
    await raw.sendCommand(["ACL", "SETUSER", "default", "-function"]);
    try {
      const err = await c.get(k).then(() => null, (e) => e);
      assert.ok(err instanceof idem.NoBackendError, String(err));
      assert.match(err.message, /FUNCTION LOAD REPLACE failed/);
    } finally {
      await raw.sendCommand(["ACL", "SETUSER", "default", "+@all"]);
    }
    await c.close();
  } finally {
    await raw.close();
  }
});

test("scripts: chosen explicitly, EVALSHA of the source without its first line; SCRIPT FLUSH between calls loads it once more", async () => {
  const raw = await plain(managed.url);
  try {
    await raw.sendCommand(["SCRIPT", "FLUSH"]);
    const c = await idem.IdemClient.connect(managed.url, { backend: "scripts" });
    assert.equal(c.backend, "scripts");
    assert.equal(c.libraryLoads, 1);
    const k = key();
    const first = await c.begin(k, fp("a"), { ttlMs, leaseMs: 5000 });
    assert.equal(first.kind, "new");
    assert.equal((await c.begin(k, fp("a"), { ttlMs })).kind, "in_flight");
    assert.deepEqual(await c.begin(k, fp("b"), { ttlMs }), { kind: "mismatch" });
    assert.ok((await c.touch(k, first.token, 4000)) <= 4000);
    await raw.sendCommand(["SCRIPT", "FLUSH"]);
    const response = idem.storedResponse(200, Buffer.from([0, 255]), [["x-a", "1"], ["x-a", "2"]]);
    await c.complete(k, first.token, response);
    assert.equal(c.libraryLoads, 2);
    assert.deepEqual(await c.begin(k, fp("a"), { ttlMs }), { kind: "replay", response });
    const got = await c.get(k);
    assert.equal(got.state, "completed");
    assert.deepEqual(got.response, response);
    const other = key();
    const t = await c.begin(other, fp("a"), { ttlMs });
    assert.equal(await c.abort(other, t.token), true);
    assert.equal(await c.abort(other, t.token), false);
    await c.close();
  } finally {
    await raw.close();
  }
});

test("auto on a server without FUNCTION (as Redis 6) runs the scripts", async () => {
  const six = await startManagedRedis("--rename-command", "FUNCTION", "");
  const c = await idem.IdemClient.connect(six.url);
  assert.equal(c.backend, "scripts");
  const k = key();
  const { token } = await c.begin(k, fp("a"), { ttlMs });
  await c.complete(k, token, idem.storedResponse(201, "six"));
  assert.equal((await c.begin(k, fp("a"), { ttlMs })).response.body.toString(), "six");
  await c.close();
});

test("a server with no idem (no module, FUNCTION renamed away, scripts denied) is one NoBackendError at start saying what to do", async () => {
  const none = await startManagedRedis("--rename-command", "FUNCTION", "", "--user", "default", "on", "nopass", "~*", "&*", "+@all", "-eval", "-evalsha", "-script");
  const err = await idem.IdemClient.connect(none.url).then(() => null, (e) => e);
  assert.ok(err instanceof idem.NoBackendError, String(err));
  assert.equal(err.isUnreachable, false, "never fail-open");
  assert.equal(err.isUnavailable, true, "answered 503");
  assert.match(err.message, /this Redis has no idem/);
  assert.match(err.message, /module: IDEM\.BEGIN does not exist/);
  assert.match(err.message, /functions: no idem library loaded, and FUNCTION LOAD REPLACE failed: ERR unknown command 'FUNCTION'[;)]/);
  assert.match(err.message, /scripts: EVALSHA failed: NOPERM /);
  assert.match(err.message, /--loadmodule/);
  assert.match(err.message, /FUNCTION LOAD REPLACE < functions\/idem\.lua/);
  // A backend chosen explicitly that the server cannot run says so too.
  const chosen = await idem.IdemClient.connect(managed.url, { backend: "module" }).then(() => null, (e) => e);
  assert.ok(chosen instanceof idem.NoBackendError, String(chosen));
  assert.match(chosen.message, /backend "module" was chosen/);
  assert.throws(() => new idem.IdemClient(null, { backend: "lua" }), TypeError);

  // The middleware (its client made without connect, so it finds out on the first request) logs it once, not per request.
  const redis = await plain(none.url);
  const client = new idem.IdemClient(redis);
  const logged = [];
  const logger = { warn: (m) => logged.push(["warn", m]), error: (m) => logged.push(["error", m]) };
  for (const [framework, makeApp] of Object.entries(FRAMEWORKS)) {
    logged.length = 0;
    const app = await makeApp({ client, logger, failOpen: true });
    try {
      for (let i = 0; i < 3; i++) {
        const res = await request(app.url, { path: "/echo", headers: [["idempotency-key", `k-${framework}-${i}`]], body: "{}" });
        assert.equal(res.status, 503, `${framework}: ${res.text}`);
        assert.equal(JSON.parse(res.text).type, HTTP.problems.unavailable.type);
      }
      assert.equal(app.calls.of(`echo:k-${framework}-0`), 0, "no fail-open: the store is reachable and misconfigured");
      assert.equal(logged.length, 1, JSON.stringify(logged));
      assert.equal(logged[0][0], "error");
      assert.match(logged[0][1], /this Redis has no idem/);
    } finally {
      await app.close();
    }
  }
  await redis.close();
});

test("waiting on the library polls BEGIN: the holder's answer soon after it completes, in_flight when the wait ends, a takeover when the lease lapses", async () => {
  const c = await idem.IdemClient.connect(managed.url);
  const k = key();
  const { token } = await c.begin(k, fp("a"), { ttlMs, leaseMs: 5000 });
  const t0 = Date.now();
  const waiting = c.begin(k, fp("a"), { ttlMs, waitMs: 3000 });
  await sleep(300);
  await c.complete(k, token, idem.storedResponse(201, "done"));
  const answer = await waiting;
  assert.equal(answer.kind, "replay");
  assert.equal(answer.response.body.toString(), "done");
  assert.ok(Date.now() - t0 < 300 + 200 + 150, `answered after ${Date.now() - t0} ms`);
  // No answer within the wait: in_flight, once the wait is over and not long after.
  const k2 = key();
  await c.begin(k2, fp("a"), { ttlMs, leaseMs: 5000 });
  const t1 = Date.now();
  assert.equal((await c.begin(k2, fp("a"), { ttlMs, waitMs: 400 })).kind, "in_flight");
  const waited = Date.now() - t1;
  assert.ok(waited >= 390 && waited < 400 + 200, `waited ${waited} ms`);
  // The interval never runs past the holder's lease: with a one-second first interval, the lapse after 150 ms is seen at once.
  const slow = new idem.IdemClient(c.redis, { pollFirstMs: 1000, pollMaxMs: 1000 });
  const k3 = key();
  const held = await slow.begin(k3, fp("a"), { ttlMs, leaseMs: 150 });
  const t2 = Date.now();
  const took = await slow.begin(k3, fp("a"), { ttlMs, leaseMs: 5000, waitMs: 3000 });
  assert.equal(took.kind, "new");
  assert.ok(took.token > held.token);
  assert.ok(Date.now() - t2 < 600, `took over after ${Date.now() - t2} ms`);
  await c.close();
});

test("error replies are bytes: an error whose text is not UTF-8 is a clean error reply, and the connection goes on", async () => {
  for (const RESP of [2, 3]) {
    const raw = await plain(managed.url, { RESP });
    let reconnects = 0;
    raw.on("connect", () => reconnects++);
    const mapping = { [RESP_TYPES.BLOB_STRING]: Buffer, [RESP_TYPES.SIMPLE_STRING]: Buffer, [RESP_TYPES.NUMBER]: String };
    const binary = Buffer.from([0xff, 0xfe, 0x80, 0x00, 0xc3, 0x28]);
    // Redis echoes the unknown command's arguments, here a binary fingerprint, as the module-less server did.
    const unknown = await raw.sendCommand(["IDEM.BEGIN", key(), binary, "60"], { typeMapping: mapping }).then(() => null, (e) => e);
    const typed = idem.fromRedis(unknown);
    assert.ok(typed instanceof idem.OtherRedisError, `RESP${RESP}: ${typed}`);
    assert.equal(typed.isUnreachable, false);
    assert.match(typed.message, /^ERR unknown command 'IDEM\.BEGIN'/);
    // An error raised by a script with such bytes.
    const script = await raw.sendCommand(["EVAL", "return redis.error_reply('BADARG ' .. ARGV[1])", "0", binary], { typeMapping: mapping }).then(() => null, (e) => e);
    const badArg = idem.fromRedis(script);
    assert.ok(badArg instanceof idem.BadArgError, `RESP${RESP}: ${badArg}`);
    assert.equal(Buffer.from(badArg.detail).length > 0, true);
    // The same connection answers the next command.
    assert.equal(String(await raw.sendCommand(["PING"])), "PONG");
    assert.equal(reconnects, 0, "the connection was never dropped");
    await raw.close();
  }
  // And through the library: binary fingerprints and values, and the error a key of another type answers.
  const redis = await plain(managed.url);
  const c = new idem.IdemClient(redis, { backend: "functions" });
  await c.ready();
  const k = key();
  await redis.sendCommand(["SET", k, Buffer.from([0xff, 0xfe])]);
  await assert.rejects(c.begin(k, Buffer.from([0xff, 0xfe, 0x80]), { ttlMs }), idem.WrongTypeError);
  assert.equal((await c.begin(key(), Buffer.from([0xff, 0xfe, 0x80]), { ttlMs })).kind, "new");
  await redis.close();
});

test("the middleware on the library: new, replay with the stored headers, 422, and a duplicate waiting for the answer", async () => {
  const c = await idem.IdemClient.connect(managed.url);
  assert.equal(c.backend, "functions");
  const quiet = { warn: () => undefined, error: () => undefined };
  for (const [framework, makeApp] of Object.entries(FRAMEWORKS)) {
    const app = await makeApp({ client: c, logger: quiet, waitForResultMs: 3000 });
    try {
      const k = `lib-${framework}-${Date.now()}`;
      const send = (body = '{"a":1}') => request(app.url, { path: "/echo", headers: [["idempotency-key", k], ["content-type", "application/json"]], body });
      const first = await send();
      assert.equal(first.status, 201);
      const again = await send();
      assert.equal(again.status, 201);
      assert.equal(again.text, first.text);
      assert.equal(again.headers[HTTP.headers.replayed], HTTP.headers.replayed_value);
      assert.equal(again.headers.location, first.headers.location);
      assert.equal(again.headers["x-not-stored"], undefined);
      assert.equal((await send('{"a":2}')).status, 422);
      assert.equal(app.calls.of(`echo:/${k}`), 1);
      const slowKey = `${k}-slow`;
      const slow = () => request(app.url, { path: "/slow?ms=400", headers: [["idempotency-key", slowKey]], body: "x" });
      const [a, b] = await Promise.all([slow(), sleep(50).then(slow)]);
      assert.equal(a.status, 201);
      assert.equal(b.status, 201);
      assert.equal(b.text, a.text);
      assert.equal(b.headers[HTTP.headers.replayed], "true");
      assert.equal(app.calls.of(`slow:/${slowKey}`), 1);
    } finally {
      await app.close();
    }
  }
  await c.close();
});

test("users that may not run COMMAND: the documented application user finds the module; a managed service's user the library", async () => {
  const servers = [];
  if (SERVER_KINDS.includes("module")) servers.push(["module", await startServer("module"), "+idem.begin +idem.complete +idem.abort +idem.touch +idem.get"]);
  // The library's functions run as the calling user: it needs the commands they call (README, "Backends").
  servers.push(["functions", managed, `+fcall +fcall_ro +function|load ${LIBRARY_COMMANDS}`]);
  for (const [backend, server, commands] of servers) {
    const raw = await plain(server.url);
    let c;
    try {
      await raw.sendCommand(["ACL", "SETUSER", "app", "reset", "on", ">app-secret", "~idem:*", "-@all", ...commands.split(" "), "+ping"]);
      const url = server.url.replace("redis://", "redis://app:app-secret@");
      c = await idem.IdemClient.connect(url);
      assert.equal(c.backend, backend);
      const k = key();
      const { token } = await c.begin(k, fp("a"), { ttlMs });
      await c.complete(k, token, idem.storedResponse(201, "acl"));
      assert.equal((await c.get(k)).state, "completed");
    } finally {
      // A failed assertion must not leave a connection that keeps the
      // test process alive.
      await c?.close();
      await raw.sendCommand(["ACL", "DELUSER", "app"]);
      await raw.close();
    }
  }
});
