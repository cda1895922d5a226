// The example as a process started through `serve`, against a redis-server
// with the module and a database of its own: the HTTP API of
// examples/payments-api (the four outcomes, GET, validation, 405, tenants),
// bad settings refused at start, and Redis forgetting keys mid-flight with
// the fence (no key paid or charged twice) and without it (the doubles
// appear: teeth).
import { test, before } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { startRedis, startManagedRedis, startTlsRedis, startTlsPostgres, certificates, emptyDatabase, freePort, cleanup, sleep } from "../../../clients/node/test/helpers.mjs";
import { request as send } from "../../../clients/node/test/apps.mjs";

/** A request as the demo caller (Bearer tok_demo) unless it carries its own Authorization or `anonymous` is set. */
const request = (url, { anonymous = false, ...options }) => {
  const headers = options.headers ?? [];
  const own = anonymous || headers.some(([name]) => name.toLowerCase() === "authorization");
  return send(url, { ...options, headers: own ? headers : [["authorization", "Bearer tok_demo"], ...headers] });
};

const SERVE = fileURLToPath(new URL("../serve", import.meta.url));
let redis;

before(async () => {
  redis = await startRedis();
});

/** Starts the app with `env` on a fresh database; resolves once GET /payments/0 answers. */
async function startApp(env = {}) {
  const db = await emptyDatabase();
  const port = await freePort();
  const proc = spawn(SERVE, [], {
    env: { ...process.env, REDIS_URL: redis.url, DATABASE_URL: db.url, PORT: String(port), PG_POOL_SIZE: "8", ...env },
    stdio: ["ignore", "ignore", "pipe"],
  });
  let stderr = "";
  proc.stderr.on("data", (c) => (stderr += c));
  const exited = new Promise((resolve) => proc.once("exit", resolve));
  const stop = async () => {
    if (proc.exitCode === null && proc.signalCode === null) proc.kill("SIGTERM");
    return exited;
  };
  cleanup(stop);
  const url = `http://127.0.0.1:${port}`;
  for (let i = 0; i < 300; i++) {
    if (proc.exitCode !== null) throw new Error(`the app exited: ${stderr}`);
    const res = await request(url, { method: "GET", path: "/payments/0" }).catch(() => null);
    if (res?.status === 404) break;
    await sleep(50);
  }
  const pool = db.pool();
  return {
    url,
    stop,
    stderr: () => stderr,
    async count(sql, params) {
      return (await pool.query(sql, params)).rows;
    },
  };
}

const JSON_CT = ["content-type", "application/json"];
/** POST /payments; `token` is the caller's bearer token (the demo caller's when absent). */
const pay = (app, key, body, token, extra = []) =>
  request(app.url, {
    path: "/payments",
    headers: [...(key ? [["idempotency-key", key]] : []), ...(token ? [["authorization", `Bearer ${token}`]] : []), JSON_CT, ...extra],
    body: typeof body === "string" ? body : JSON.stringify(body),
  });

test("the HTTP API: the four outcomes, GET, validation, 405, tenants", async () => {
  const app = await startApp({ PROCESSOR_DELAY_MS: "300" });
  const body = { amount: 500, currency: "EUR", recipient: " alice " };
  const [first, during] = await Promise.all([pay(app, "k1", body, "tok_a"), sleep(100).then(() => pay(app, "k1", body, "tok_a"))]);
  assert.equal(first.status, 201, first.text);
  const payment = JSON.parse(first.text);
  assert.deepEqual(Object.keys(payment), ["id", "amount", "currency", "recipient", "created_at"]);
  assert.equal(payment.recipient, "alice");
  assert.match(payment.created_at, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$/);
  assert.equal(first.headers.location, `/payments/${payment.id}`);
  assert.equal(during.status, 409);
  assert.ok(["1", "2"].includes(during.headers["retry-after"]));
  const replay = await pay(app, "k1", { recipient: " alice ", currency: "EUR", amount: 500 }, "tok_a");
  assert.equal(replay.status, 201);
  assert.equal(replay.text, first.text);
  assert.equal(replay.headers["idempotent-replayed"], "true");
  assert.equal((await pay(app, "k1", { ...body, amount: 501 }, "tok_a")).status, 422);
  const other = await pay(app, "k1", body, "tok_b");
  assert.equal(other.status, 201);
  assert.notEqual(JSON.parse(other.text).id, payment.id, "another tenant's key is its own");
  // The account is the bearer token's: an X-Account-Id the client sends is not trusted.
  const spoofed = await pay(app, "k1", body, "tok_demo", [["x-account-id", "acct_a"]]);
  assert.equal(spoofed.status, 201);
  assert.equal(spoofed.headers["idempotent-replayed"], undefined, "acct_a's payment went to the demo caller");
  assert.notEqual(JSON.parse(spoofed.text).id, payment.id);
  for (const authorization of [null, "Bearer tok_unknown", "tok_a", "Basic tok_a"]) {
    const headers = [["idempotency-key", "k1"], JSON_CT, ...(authorization ? [["authorization", authorization]] : [])];
    const refused = await request(app.url, { path: "/payments", headers, body: JSON.stringify(body), anonymous: true });
    assert.equal(refused.status, 401, String(authorization));
    assert.equal(JSON.parse(refused.text).error, "unauthorized");
    assert.equal(refused.headers["www-authenticate"], "Bearer");
  }
  const got = await request(app.url, { method: "GET", path: `/payments/${payment.id}` });
  assert.equal(got.status, 200);
  assert.equal(got.text, first.text, "GET answers the POST's bytes (its id and created_at)");
  assert.equal((await request(app.url, { method: "GET", path: "/payments/99999999999999999999" })).status, 400);
  assert.equal((await request(app.url, { method: "GET", path: "/payments/abc" })).status, 400);
  assert.equal(JSON.parse((await request(app.url, { method: "GET", path: "/payments/0" })).text).error, "not_found");
  assert.equal((await request(app.url, { method: "PUT", path: "/payments" })).status, 405);
  assert.equal((await request(app.url, { method: "DELETE", path: "/payments/1" })).status, 405);
  const bad = [
    ["not json", 400, "invalid_json"],
    ["", 400, "invalid_json"],
    [{ amount: 5, currency: "EUR" }, 422, "invalid_payment"],
    [{ amount: 5, currency: "EUR", recipient: "x", memo: 1 }, 422, "invalid_payment"],
    [{ amount: "5", currency: "EUR", recipient: "x" }, 422, "invalid_payment"],
    [{ amount: 1.5, currency: "EUR", recipient: "x" }, 422, "invalid_payment"],
    [{ amount: 0, currency: "EUR", recipient: "x" }, 422, "invalid_payment"],
    [{ amount: 5, currency: "eur", recipient: "x" }, 422, "invalid_payment"],
    [{ amount: 5, currency: "EUR", recipient: "r".repeat(201) }, 422, "invalid_payment"],
    ["[5, \"EUR\", \"x\"]", 422, "invalid_payment"],
  ];
  for (const [i, [b, status, code]] of bad.entries()) {
    const res = await pay(app, `bad-${i}`, b);
    assert.equal(res.status, status, JSON.stringify(b));
    assert.equal(JSON.parse(res.text).error, code);
    const again = await pay(app, `bad-${i}`, b);
    assert.equal(again.headers["idempotent-replayed"], "true", "a 4xx is stored");
  }
  // A recipient Postgres refuses (a NUL byte) is a 500: not stored, the retry runs again.
  const nul = { amount: 5, currency: "EUR", recipient: "a\u0000b" };
  assert.equal((await pay(app, "nul", nul)).status, 500);
  assert.equal((await pay(app, "nul", nul)).headers["idempotent-replayed"], undefined);
  // No key: no idempotency, each request pays.
  assert.equal((await pay(app, null, body)).status, 201);
  await app.stop();
});

test("on a managed Redis (no module) the library runs: its start-up log says which backend, payments are kept single", async () => {
  const managed = await startManagedRedis();
  for (const backend of ["auto", "functions", "scripts"]) {
    const app = await startApp({ REDIS_URL: managed.url, BACKEND: backend, PROCESSOR_DELAY_MS: "200" });
    const expected = backend === "auto" ? "functions" : backend;
    assert.match(app.stderr(), new RegExp(`listening on .*\\(backend=${expected}, `), app.stderr());
    const body = { amount: 700, currency: "EUR", recipient: backend };
    const [first, during] = await Promise.all([pay(app, `m-${backend}`, body), sleep(60).then(() => pay(app, `m-${backend}`, body))]);
    assert.equal(first.status, 201, first.text);
    assert.equal(during.status, 409);
    const replay = await pay(app, `m-${backend}`, body);
    assert.equal(replay.text, first.text);
    assert.equal(replay.headers["idempotent-replayed"], "true");
    assert.equal((await pay(app, `m-${backend}`, { ...body, amount: 701 })).status, 422);
    const [{ n }] = await app.count("SELECT count(*)::int AS n FROM payments WHERE recipient = $1", [backend]);
    assert.equal(n, 1);
    await app.stop();
  }
  // With the module asked for, it says so once at start and exits.
  const db = await emptyDatabase();
  const proc = spawn(SERVE, [], {
    env: { ...process.env, REDIS_URL: managed.url, DATABASE_URL: db.url, PORT: String(await freePort()), BACKEND: "module" },
    stdio: ["ignore", "ignore", "pipe"],
  });
  let stderr = "";
  proc.stderr.on("data", (c) => (stderr += c));
  const code = await new Promise((resolve) => proc.once("exit", resolve));
  assert.equal(code, 1);
  assert.match(stderr, /connect to Redis: NoBackendError: backend "module" was chosen and this Redis cannot run it .*--loadmodule/);
  assert.equal(stderr.match(/NoBackendError/g).length, 1, stderr);
});

test("a Redis without idem (no module, no loadable library) is reported once at start with what to do", async () => {
  const none = await startManagedRedis("--rename-command", "FUNCTION", "", "--user", "default", "on", "nopass", "~*", "&*", "+@all", "-eval", "-evalsha", "-script");
  const db = await emptyDatabase();
  const proc = spawn(SERVE, [], {
    env: { ...process.env, REDIS_URL: none.url, DATABASE_URL: db.url, PORT: String(await freePort()) },
    stdio: ["ignore", "ignore", "pipe"],
  });
  let stderr = "";
  proc.stderr.on("data", (c) => (stderr += c));
  const code = await new Promise((resolve) => proc.once("exit", resolve));
  assert.equal(code, 1);
  assert.match(stderr, /this Redis has no idem \(module: .*; functions: .*; scripts: .*\)\. Load the module/);
  assert.equal(stderr.match(/this Redis has no idem/g).length, 1, stderr);
});

test("TLS with client certificates: Redis (REDIS_CA_CERT, REDIS_CLIENT_CERT, REDIS_CLIENT_KEY) and Postgres (DATABASE_URL's sslrootcert, sslcert, sslkey); without one it stops at start with TLS' reason", async () => {
  const certs = certificates();
  const tlsRedis = await startTlsRedis(certs);
  const tlsPg = await startTlsPostgres(certs);
  const url = tlsRedis.url.replace("127.0.0.1", "localhost");
  const pgTls = { sslmode: "verify-full", sslrootcert: certs.ca };
  const databaseUrl = tlsPg.url({ ...pgTls, sslcert: certs.postgres.crt, sslkey: certs.postgres.key });
  const redisTls = { REDIS_URL: url, REDIS_CA_CERT: certs.ca, REDIS_CLIENT_CERT: certs.client.crt, REDIS_CLIENT_KEY: certs.client.key };
  const app = await startApp({ ...redisTls, DATABASE_URL: databaseUrl });
  const body = { amount: 300, currency: "EUR", recipient: "tls" };
  const first = await pay(app, "tls-1", body);
  assert.equal(first.status, 201, first.text + app.stderr());
  assert.equal((await pay(app, "tls-1", body)).headers["idempotent-replayed"], "true");
  await app.stop();
  const db = await emptyDatabase();
  const proc = spawn(SERVE, [], {
    env: { ...process.env, REDIS_URL: url, DATABASE_URL: db.url, PORT: String(await freePort()), REDIS_CA_CERT: certs.ca },
    stdio: ["ignore", "ignore", "pipe"],
  });
  let stderr = "";
  proc.stderr.on("data", (c) => (stderr += c));
  assert.equal(await new Promise((resolve) => proc.once("exit", resolve)), 1);
  // TLS 1.3's "certificate required" comes after the handshake: the client reads it, or only the reset after it.
  assert.match(stderr, /connect to Redis: (OtherRedisError: TLS to rediss:\/\/localhost:\d+\/ failed: .*certificate required|UnavailableError: .*does it want a client certificate\?)/);
  const noPgCert = spawn(SERVE, [], {
    env: { ...process.env, ...redisTls, DATABASE_URL: tlsPg.url(pgTls), PORT: String(await freePort()) },
    stdio: ["ignore", "ignore", "pipe"],
  });
  let pgErr = "";
  noPgCert.stderr.on("data", (c) => (pgErr += c));
  assert.equal(await new Promise((resolve) => noPgCert.once("exit", resolve)), 1);
  assert.match(pgErr, /migrate: .*client certificate/);
});

test("bad settings are refused before the service starts", async () => {
  for (const [env, message] of [[{ FENCE: "maybe" }, 'FENCE="maybe": use on or off'], [{ PORT: "70000" }, 'PORT="70000"']]) {
    const proc = spawn(SERVE, [], { env: { ...process.env, DATABASE_URL: "postgres://127.0.0.1:1/none", ...env }, stdio: ["ignore", "ignore", "pipe"] });
    let stderr = "";
    proc.stderr.on("data", (c) => (stderr += c));
    const code = await new Promise((resolve) => proc.once("exit", resolve));
    assert.notEqual(code, 0);
    assert.ok(stderr.includes(message), stderr);
  }
});

/** Redis forgets every in-progress key while the originals are in the processor; each key's retry arrives. */
async function redisForgetsMidFlight(fence) {
  const app = await startApp({ FENCE: fence, PROCESSOR_DELAY_MS: "800", LEASE_MS: "3000", READ_THROUGH: "on" });
  const raw = await redis.raw();
  const keys = Array.from({ length: 6 }, (_, i) => `chaos-${fence}-${i}`);
  const body = (k) => ({ amount: 100, currency: "EUR", recipient: k });
  // Well-behaved clients: each retries on 409 until answered.
  const client = async (k) => {
    for (let i = 0; i < 100; i++) {
      const res = await pay(app, k, body(k));
      if (res.status !== 409) return res;
      await sleep(100);
    }
    throw new Error("still 409");
  };
  const originals = keys.map(client);
  await sleep(300);
  await raw.flushAll();
  const retries = keys.map(client);
  const answers = await Promise.all([...originals, ...retries]);
  for (const a of answers) assert.equal(a.status, 201, a.text);
  const paid = await app.count("SELECT recipient, count(*)::int AS n FROM payments GROUP BY recipient");
  const charged = await app.count("SELECT count(*)::int AS n FROM processor_charges");
  await app.stop();
  return { doubles: paid.filter((r) => r.n > 1).length, payments: paid.reduce((s, r) => s + r.n, 0), charges: charged[0].n };
}

test("Redis forgets keys mid-flight: with the fence no key is paid or charged twice", async () => {
  const r = await redisForgetsMidFlight("on");
  assert.deepEqual(r, { doubles: 0, payments: 6, charges: 6 });
});

test("teeth: the same without the fence pays every key twice", async () => {
  const r = await redisForgetsMidFlight("off");
  assert.equal(r.doubles, 6, JSON.stringify(r));
  assert.equal(r.charges, 12);
});
