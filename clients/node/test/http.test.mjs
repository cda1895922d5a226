// The Express middleware and the Fastify plugin over a real redis-server
// with the module (and Postgres for read-through and the fence): the HTTP
// semantics of the Rust layer, facts from spec/http.json, each scenario run
// against both adapters.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import * as idem from "../dist/index.js";
import { startRedis, database, loadSpec, b, sleep } from "./helpers.mjs";
import { FRAMEWORKS, request } from "./apps.mjs";

const HTTP = loadSpec("http.json");
const JSON_CT = ["content-type", "application/json"];
let server;
let client;
let db;
const quiet = { warn: () => undefined, error: () => undefined };
let n = 0;
const newKey = () => `k-${process.pid}-${Date.now()}-${n++}`;

before(async () => {
  server = await startRedis();
  client = await idem.IdemClient.connect(server.url);
  db = await database();
});
after(async () => {
  await client.close();
});

function assertProblem(res, name) {
  const p = HTTP.problems[name];
  assert.equal(res.status, p.status, res.text);
  assert.equal(res.headers["content-type"], HTTP.headers.problem_content_type);
  const body = JSON.parse(res.text);
  assert.equal(body.type, p.type);
  assert.equal(body.title, p.title);
  assert.equal(body.status, p.status);
  return body;
}

for (const [framework, makeApp] of Object.entries(FRAMEWORKS)) {
  const withApp = async (options, f, extra) => {
    const app = await makeApp({ client, logger: quiet, ...options }, extra);
    try {
      await f(app);
    } finally {
      await app.close();
    }
  };

  test(`${framework}: new, then the stored response replayed with Idempotent-Replayed; stored headers only`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      const send = () => request(app.url, { path: "/echo", headers: [["idempotency-key", k], JSON_CT], body: '{"a":1}' });
      const first = await send();
      assert.equal(first.status, 201);
      assert.equal(first.headers["idempotent-replayed"], undefined);
      assert.equal(first.headers["x-not-stored"], "yes");
      const again = await send();
      assert.equal(again.status, 201);
      assert.equal(again.text, first.text);
      assert.equal(again.headers[HTTP.headers.replayed], HTTP.headers.replayed_value);
      assert.equal(again.headers.location, first.headers.location);
      assert.equal(again.headers["content-type"], first.headers["content-type"]);
      assert.equal(again.headers["x-not-stored"], undefined, "only stored_headers are stored");
      // Canonical JSON: the same members in another order and spacing are the same request.
      const reordered = await request(app.url, { path: "/echo", headers: [["idempotency-key", k], JSON_CT], body: '{ "a" : 1 }' });
      assert.equal(reordered.status, 201);
      assert.equal(reordered.headers[HTTP.headers.replayed], "true");
      assert.equal(app.calls.of(`echo:/${k}`), 1);
      // GET is not covered: it passes through every time.
      await request(app.url, { method: "GET", path: "/echo", headers: [["idempotency-key", k]] });
      await request(app.url, { method: "GET", path: "/echo", headers: [["idempotency-key", k]] });
      assert.equal(app.calls.of("get"), 2);
    }));

  test(`${framework}: a key reused for another request is 422`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      await request(app.url, { path: "/echo", headers: [["idempotency-key", k], JSON_CT], body: '{"a":1}' });
      assertProblem(await request(app.url, { path: "/echo", headers: [["idempotency-key", k], JSON_CT], body: '{"a":2}' }), "mismatch");
      assertProblem(await request(app.url, { path: "/echo?x=1", headers: [["idempotency-key", k], JSON_CT], body: '{"a":1}' }), "mismatch");
    }));

  test(`${framework}: a duplicate of a running request is 409 with Retry-After, capped`, () =>
    withApp({ leaseMs: 5000 }, async (app) => {
      const k = newKey();
      const slow = request(app.url, { path: "/slow?ms=600", headers: [["idempotency-key", k]] });
      await sleep(150);
      const dup = await request(app.url, { path: "/slow?ms=600", headers: [["idempotency-key", k]] });
      assertProblem(dup, "in_flight");
      assert.equal(dup.headers["retry-after"], String(HTTP.defaults.max_retry_after_ms / 1000));
      assert.equal((await slow).status, 201);
      assert.equal(app.calls.of(`slow:/${k}`), 1);
    }));

  test(`${framework}: 5xx and 429 are not stored; the retry runs again`, () =>
    withApp({}, async (app) => {
      for (const code of [500, 503, 429]) {
        const k = newKey();
        for (let i = 0; i < 2; i++) assert.equal((await request(app.url, { path: `/status?code=${code}`, headers: [["idempotency-key", k]] })).status, code);
        assert.equal(app.calls.of(`status:/${k}`), 2, String(code));
      }
      const k = newKey();
      for (let i = 0; i < 2; i++) assert.equal((await request(app.url, { path: "/status?code=404", headers: [["idempotency-key", k]] })).status, 404);
      assert.equal(app.calls.of(`status:/${k}`), 1, "a 404 is stored");
    }));

  test(`${framework}: bad, missing and repeated keys`, async () => {
    await withApp({}, async (app) => {
      for (const [value, kind] of [["", "empty"], ["a,b", "malformed"], ['"open', "malformed"], ["x".repeat(256), "too_long"]]) {
        const res = await request(app.url, { path: "/echo", headers: [["idempotency-key", value]] });
        assert.equal(assertProblem(res, "invalid_key").detail, HTTP.key_errors[kind], value);
      }
      const twice = await request(app.url, { path: "/echo", headers: [["idempotency-key", "a"], ["idempotency-key", "b"]] });
      assert.equal(assertProblem(twice, "invalid_key").detail, HTTP.key_errors.repeated);
      // No key, not required: the handler runs unprotected, each time.
      await request(app.url, { path: "/echo" });
      await request(app.url, { path: "/echo" });
      assert.equal(app.calls.of("echo:/-"), 2);
    });
    await withApp({ required: true }, async (app) => {
      assertProblem(await request(app.url, { path: "/echo" }), "missing_key");
      assert.equal(app.calls.of("echo:/-"), 0);
    });
  });

  test(`${framework}: a large request is 413; a large response is sent, not stored`, () =>
    withApp({ maxRequestBody: 1000, maxResponseBody: 2000 }, async (app) => {
      assertProblem(await request(app.url, { path: "/echo", headers: [["idempotency-key", newKey()]], body: "y".repeat(1001) }), "request_too_large");
      const k = newKey();
      for (let i = 0; i < 2; i++) {
        const res = await request(app.url, { path: "/big?size=5000", headers: [["idempotency-key", k]] });
        assert.equal(res.status, 200);
        assert.equal(res.body.length, 5000);
      }
      assert.equal(app.calls.of(`big:/${k}`), 2);
      const small = newKey();
      await request(app.url, { path: "/big?size=1500", headers: [["idempotency-key", small]] });
      assert.equal((await request(app.url, { path: "/big?size=1500", headers: [["idempotency-key", small]] })).headers["idempotent-replayed"], "true");
    }));

  test(`${framework}: a streamed response is stored and replayed; past maxResponseBody it is sent whole, not stored`, () =>
    withApp({ maxResponseBody: 4000 }, async (app) => {
      const k = newKey();
      const send = (size) => request(app.url, { path: `/stream?size=${size}`, headers: [["idempotency-key", k]] });
      const first = await send(3500);
      assert.equal(first.status, 201);
      assert.equal(first.body.length, 3500);
      const again = await send(3500);
      assert.equal(again.headers["idempotent-replayed"], "true", "the streamed response was stored");
      assert.equal(again.text, first.text);
      assert.equal(again.headers.location, first.headers.location);
      assert.equal(app.calls.of(`stream:/${k}`), 1);
      const big = newKey();
      for (let i = 1; i <= 2; i++) {
        const res = await request(app.url, { path: "/stream?size=9500", headers: [["idempotency-key", big]] });
        assert.equal(res.status, 201);
        assert.equal(res.text, `${i}:`.padEnd(9500, "s"), "the buffered part, then the rest, in order");
        assert.equal(res.headers["idempotent-replayed"], undefined);
      }
      assert.equal(app.calls.of(`stream:/${big}`), 2, "too large to store: the key was released");
    }));

  test(`${framework}: tenants scope keys`, () =>
    withApp({ tenantHeader: "x-account-id" }, async (app) => {
      const k = newKey();
      const as = (tenant) => request(app.url, { path: "/echo", headers: [["idempotency-key", k], ["x-account-id", tenant]] });
      assert.equal((await as("acct-1")).status, 201);
      const other = await as("acct-2");
      assert.equal(other.status, 201);
      assert.equal(other.headers["idempotent-replayed"], undefined, "another tenant's key is its own");
      assert.equal((await as("acct-1")).headers["idempotent-replayed"], "true");
      assert.equal((await client.get(idem.redisKey(HTTP.defaults.key_prefix, "acct-1", k))).state, "completed");
      assert.equal((await client.get(idem.redisKey(HTTP.defaults.key_prefix, "acct-2", k))).state, "completed");
    }));

  test(`${framework}: a tenant header that is missing, empty or too long is refused`, () =>
    withApp({ tenantHeader: "x-account-id" }, async (app) => {
      const k = newKey();
      const as = (lines) => request(app.url, { path: "/echo", headers: [["idempotency-key", k], ...lines.map((t) => ["x-account-id", t])] });
      assertProblem(await as([]), "missing_tenant");
      assertProblem(await as([""]), "missing_tenant");
      assertProblem(await as(["a".repeat(8192)]), "invalid_tenant");
      assertProblem(await as(["a".repeat(129)]), "invalid_tenant");
      assert.equal(app.calls.of(`echo:/${k}`) + app.calls.of(`echo:${"a".repeat(129)}/${k}`), 0, "no refused request ran");
      assert.equal(await client.get(idem.redisKey(HTTP.defaults.key_prefix, "", k)), null, "no anonymous scope");
      assert.equal((await as(["a".repeat(128)])).status, 201, "at the bound");
    }));

  test(`${framework}: the tenant comes from the authenticated caller (the framework's request)`, async () => {
    const tokens = { tok_a: "acct_1", tok_b: "acct_2", tok_empty: "", tok_128: "a".repeat(128), tok_129: "a".repeat(129), tok_utf8_129: "\u00e9".repeat(64) + "a" };
    const accountOf = (headers) => {
      const auth = headers.authorization ?? "";
      return auth.startsWith("Bearer ") ? tokens[auth.slice(7)] : undefined;
    };
    const before =
      framework === "express"
        ? (app) =>
            app.use((req, _res, next) => {
              req.account = accountOf(req.headers);
              next();
            })
        : (app) =>
            app.addHook("onRequest", async (request) => {
              request.account = accountOf(request.headers);
            });
    const app = await makeApp({ client, logger: quiet, tenant: (r) => r.source.account }, () => ({}), before);
    try {
      const k = newKey();
      const as = (token) => request(app.url, { path: "/echo", headers: [["idempotency-key", k], ...(token === undefined ? [] : [["authorization", `Bearer ${token}`]])] });
      const a = await as("tok_a");
      const b = await as("tok_b");
      assert.equal(a.status, 201);
      assert.equal(b.status, 201);
      assert.equal(b.headers["idempotent-replayed"], undefined, "acct_1's response went to acct_2");
      assert.equal((await as("tok_a")).headers["idempotent-replayed"], "true");
      assert.equal(app.calls.of(`echo:/${k}`), 2);
      for (const token of [undefined, "tok_unknown", "tok_empty"]) assertProblem(await as(token), "missing_tenant");
      for (const token of ["tok_129", "tok_utf8_129"]) assertProblem(await as(token), "invalid_tenant");
      assert.equal(app.calls.of(`echo:/${k}`), 2, "no refused request ran");
      assert.equal(await client.get(idem.redisKey(HTTP.defaults.key_prefix, "", k)), null, "no anonymous scope");
      assert.equal((await as("tok_128")).status, 201, "at the bound");
      assert.equal((await client.get(idem.redisKey(HTTP.defaults.key_prefix, "a".repeat(128), k))).state, "completed");
    } finally {
      await app.close();
    }
  });

  test(`${framework}: without a tenant source every caller shares one scope`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      const first = await request(app.url, { path: "/echo", headers: [["idempotency-key", k], ["authorization", "Bearer tok_a"]] });
      const other = await request(app.url, { path: "/echo", headers: [["idempotency-key", k], ["authorization", "Bearer tok_b"]] });
      assert.equal(first.status, 201);
      assert.equal(other.headers["idempotent-replayed"], "true");
      assert.notEqual(await client.get(idem.redisKey(HTTP.defaults.key_prefix, "", k)), null);
    }));

  test(`${framework}: wait_for_result gives a duplicate the original's answer`, () =>
    withApp({ waitForResultMs: 3000 }, async (app) => {
      const k = newKey();
      const slow = request(app.url, { path: "/slow?ms=500", headers: [["idempotency-key", k]] });
      await sleep(100);
      const dup = await request(app.url, { path: "/slow?ms=500", headers: [["idempotency-key", k]] });
      const first = await slow;
      assert.equal(dup.status, 201);
      assert.equal(dup.text, first.text);
      assert.equal(dup.headers["idempotent-replayed"], "true");
      assert.equal(app.calls.of(`slow:/${k}`), 1);
    }));

  test(`${framework}: the lease is renewed while the handler runs`, () =>
    withApp({ leaseMs: 300 }, async (app) => {
      const k = newKey();
      const slow = request(app.url, { path: "/slow?ms=1000", headers: [["idempotency-key", k]] });
      await sleep(700); // past two leases: only renewal keeps the key
      assertProblem(await request(app.url, { path: "/slow?ms=1000", headers: [["idempotency-key", k]] }), "in_flight");
      assert.equal((await slow).status, 201);
      assert.equal(app.calls.of(`slow:/${k}`), 1);
    }));

  test(`${framework}: Redis down is 503 with Retry-After (fail closed), or the handler runs with failOpen`, async () => {
    const own = await startRedis();
    const c = await idem.IdemClient.connect(own.url, { callTimeoutMs: 500 });
    await own.stop();
    try {
      await withApp({ client: c }, async (app) => {
        const res = await request(app.url, { path: "/echo", headers: [["idempotency-key", newKey()]] });
        assertProblem(res, "unavailable");
        assert.equal(res.headers["retry-after"], HTTP.problems.unavailable.retry_after);
        assert.equal(app.calls.of("echo:/-"), 0);
      });
      await withApp({ client: c, failOpen: true }, async (app) => {
        const k = newKey();
        assert.equal((await request(app.url, { path: "/echo", headers: [["idempotency-key", k]] })).status, 201);
        assert.equal(app.calls.of(`echo:/${k}`), 1);
      });
    } finally {
      await c.close();
    }
  });

  test(`${framework}: a failing handler answers 500 and releases its key`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      assert.equal((await request(app.url, { path: "/boom", headers: [["idempotency-key", k]] })).status, 500);
      assert.equal((await request(app.url, { path: "/boom", headers: [["idempotency-key", k]] })).status, 500);
      assert.equal(app.calls.of(`boom:/${k}`), 2);
    }));

  test(`${framework}: a key lost while the handler ran is stored under a new token`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      const raw = await server.raw();
      const slow = request(app.url, { path: "/slow?ms=400", headers: [["idempotency-key", k]] });
      await sleep(150);
      await raw.del(idem.redisKey(HTTP.defaults.key_prefix, "", k)); // Redis forgets the key mid-flight
      assert.equal((await slow).status, 201);
      const again = await request(app.url, { path: "/slow?ms=400", headers: [["idempotency-key", k]] });
      assert.equal(again.headers["idempotent-replayed"], "true");
      assert.equal(app.calls.of(`slow:/${k}`), 1);
    }));

  test(`${framework}: read-through replays from the Postgres mirror after Redis forgets`, () =>
    withApp({ readThrough: new idem.ReadThrough(db.pool()) }, async (app) => {
      const k = newKey();
      const send = () => request(app.url, { path: "/echo", headers: [["idempotency-key", k], JSON_CT], body: '{"a":1}' });
      const first = await send();
      const rkey = idem.redisKey(HTTP.defaults.key_prefix, "", k);
      const rec = await client.get(rkey);
      // What the writer would have mirrored.
      await db.pool().query(
        `INSERT INTO idempotency_keys (key, fingerprint, status, token, created_at, expires_at, response_status, response_body, response_headers, completed_at)
         VALUES ($1, $2, 'completed', $3, now(), now() + interval '1 day', $4, $5, $6, now())`,
        [rkey, rec.fingerprintHex, rec.token.toString(), rec.response.status, rec.response.body, rec.response.headers.flatMap(([n, v]) => [Buffer.from(n), v])],
      );
      const raw = await server.raw();
      await raw.del(rkey);
      const again = await send();
      assert.equal(again.status, 201);
      assert.equal(again.text, first.text);
      assert.equal(again.headers["idempotent-replayed"], "true");
      assert.equal((await client.get(rkey)).mirror, "mirrored", "Redis refilled from the mirror");
      assertProblem(await request(app.url, { path: "/echo", headers: [["idempotency-key", k], JSON_CT], body: '{"a":2}' }), "mismatch");
      assert.equal(app.calls.of(`echo:/${k}`), 1);
    }));

  test(`${framework}: requests are fingerprinted as the Rust layer does (spec/vectors/fingerprint.json)`, () =>
    withApp({ tenantHeader: undefined }, async (app) => {
      const cases = loadSpec("vectors/fingerprint.json").cases.filter(
        (c) => c.request.method === "POST" && c.fingerprinter.canonical_json === HTTP.defaults.canonical_json && c.fingerprinter.headers.length === 0,
      );
      for (const c of cases) {
        const k = newKey();
        const headers = [["idempotency-key", k], ...c.request.headers.map(([name, v]) => [name, b(v).toString("latin1")])];
        await request(app.url, { path: c.request.target, headers, body: b(c.request.body) });
        const rec = await client.get(idem.redisKey(HTTP.defaults.key_prefix, "", k));
        assert.equal(rec.fingerprintHex, c.expected.stored_hex, c.name);
      }
    }));

  if (framework === "express") {
    test("express: mounted after a body parser, the middleware refuses to guess the request's bytes", async () => {
      const { default: express } = await import("express");
      const { idempotency } = await import("../dist/express.js");
      const app = express();
      app.use(express.json());
      app.use(idempotency({ client, logger: quiet }));
      let runs = 0;
      app.post("/late", (_req, res) => {
        runs++;
        res.status(201).send("ran");
      });
      // eslint-disable-next-line no-unused-vars -- Express tells error handlers by their four parameters
      app.use((err, _req, res, _next) => res.status(500).send(err.message));
      const server = app.listen(0, "127.0.0.1");
      await new Promise((resolve) => server.once("listening", resolve));
      try {
        const res = await request(`http://127.0.0.1:${server.address().port}`, { path: "/late", headers: [["idempotency-key", newKey()], JSON_CT], body: '{"a":1}' });
        assert.equal(res.status, 500);
        assert.match(res.text, /before body parsers/);
        assert.equal(runs, 0);
      } finally {
        server.closeAllConnections();
        await new Promise((resolve) => server.close(resolve));
      }
    });
  }

  test(`${framework}: a client hanging up does not cut the flow short`, () =>
    withApp({}, async (app) => {
      const k = newKey();
      const url = new URL(app.url);
      const req = http.request({ host: url.hostname, port: url.port, method: "POST", path: "/slow?ms=400", headers: { "idempotency-key": k, "content-length": 0 }, agent: false });
      req.on("error", () => undefined);
      req.end();
      await sleep(100);
      req.destroy(); // the client hangs up while the handler runs
      let record = null;
      for (let i = 0; i < 100 && record?.state !== "completed"; i++) {
        await sleep(20);
        record = await client.get(idem.redisKey(HTTP.defaults.key_prefix, "", k));
      }
      assert.equal(record?.state, "completed");
      assert.equal(record.response.status, 201);
      assert.equal((await request(app.url, { path: "/slow?ms=400", headers: [["idempotency-key", k]] })).headers["idempotent-replayed"], "true");
      assert.equal(app.calls.of(`slow:/${k}`), 1);
    }));

  test(`${framework}: a full Redis answers a new key 503, and keeps a finished one held until it can store it`, async () => {
    const own = await startRedis();
    const c = await idem.IdemClient.connect(own.url);
    const raw = await own.raw();
    const maxmemory = (v) => raw.sendCommand(["CONFIG", "SET", "maxmemory", String(v)]);
    try {
      await withApp({ client: c, storeRetryMs: 10_000 }, async (app) => {
        await maxmemory(1);
        assertProblem(await request(app.url, { path: "/echo", headers: [["idempotency-key", newKey()]] }), "unavailable");
        assert.equal(app.calls.of("echo:/-"), 0);
        await maxmemory(0);
        // Redis fills up while the handler runs: COMPLETE is refused (OOM); the key stays held (a retry is 409,
        // not a second run) and the response is stored in the background once memory is freed.
        const k = newKey();
        const first = request(app.url, { path: "/slow?ms=300", headers: [["idempotency-key", k]] });
        await sleep(100);
        await maxmemory(1);
        const answered = await first;
        assert.equal(answered.status, 201);
        assertProblem(await request(app.url, { path: "/slow?ms=300", headers: [["idempotency-key", k]] }), "in_flight");
        await maxmemory(0);
        let record = null;
        for (let i = 0; i < 100 && record?.state !== "completed"; i++) {
          await sleep(50);
          record = await c.get(idem.redisKey(HTTP.defaults.key_prefix, "", k));
        }
        const replay = await request(app.url, { path: "/slow?ms=300", headers: [["idempotency-key", k]] });
        assert.equal(replay.headers["idempotent-replayed"], "true");
        assert.equal(replay.text, answered.text);
        assert.equal(app.calls.of(`slow:/${k}`), 1);
      });
    } finally {
      await maxmemory(0).catch(() => undefined);
      await c.close();
    }
  });
}

test("fastify: a payload an earlier onSend hook turned into a stream is stored and replayed", async () => {
  const { fastifyApp, streamOf } = await import("./apps.mjs");
  // What an encoder registered before the plugin does to the payload (here without encoding it).
  const app = await fastifyApp({ client, logger: quiet }, () => ({}), (fastify) => {
    fastify.addHook("onSend", async (_request, _reply, payload) => (Buffer.isBuffer(payload) ? streamOf(payload) : payload));
  });
  try {
    const k = newKey();
    const send = () => request(app.url, { path: "/echo", headers: [["idempotency-key", k], JSON_CT], body: '{"a":1}' });
    const first = await send();
    assert.equal(first.status, 201);
    const again = await send();
    assert.equal(again.headers["idempotent-replayed"], "true");
    assert.equal(again.text, first.text);
    assert.equal(app.calls.of(`echo:/${k}`), 1, "the retry was not run again");
  } finally {
    await app.close();
  }
});

test("fastify: the plugin refuses to be registered after @fastify/compress", async () => {
  const { default: Fastify } = await import("fastify");
  const { idempotencyPlugin } = await import("../dist/fastify.js");
  const app = Fastify();
  // @fastify/compress as Fastify knows it: a plugin named so, sharing its parent's context.
  const compress = (_fastify, _options, done) => done();
  compress[Symbol.for("skip-override")] = true;
  compress[Symbol.for("plugin-meta")] = { name: "@fastify/compress" };
  try {
    await app.register(compress);
    await assert.rejects(async () => {
      await app.register(idempotencyPlugin, { client, logger: quiet });
    }, /register @fastify\/compress after idempotencyPlugin/);
  } finally {
    await app.close().catch(() => undefined);
  }
});

test("express: JSON that does not parse is express.json()'s 400 once the key is held, stored and replayed; the handler does not run", async () => {
  const { default: express } = await import("express");
  const { idempotency } = await import("../dist/express.js");
  const app = express();
  app.use(idempotency({ client, logger: quiet }));
  app.use(express.json()); // finds the body read: does nothing
  let runs = 0;
  app.post("/json", (req, res) => {
    runs++;
    res.status(201).json({ got: req.body });
  });
  const server = http.createServer(app);
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const base = `http://127.0.0.1:${server.address().port}`;
  try {
    const k = newKey();
    const send = (body) => request(base, { path: "/json", headers: [["idempotency-key", k], JSON_CT], body });
    const first = await send('{"a":');
    assert.equal(first.status, 400, first.text);
    assert.equal(runs, 0, "the handler did not run with req.body undefined");
    const again = await send('{"a":');
    assert.equal(again.status, 400);
    assert.equal(again.headers["idempotent-replayed"], "true", "the 400 is the key's stored answer, as on Fastify");
    const ok = await request(base, { path: "/json", headers: [["idempotency-key", newKey()], JSON_CT], body: '{"a":1}' });
    assert.equal(ok.status, 201);
    assert.deepEqual(JSON.parse(ok.text), { got: { a: 1 } });
    assert.equal(runs, 1);
  } finally {
    server.closeAllConnections();
    await new Promise((resolve) => server.close(resolve));
  }
});
