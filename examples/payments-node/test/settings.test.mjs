// The environment, as examples/payments-api/src/config.rs reads it (the
// same defaults, and the same refusals, naming the variable); the DDL and
// advisory locks shared with the Rust example and the writer, held to their
// Rust sources so the two cannot drift apart.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { fromLookup, parseTokens, SettingsError } from "../src/config.js";
import * as db from "../src/db.js";

const REPO = new URL("../../../", import.meta.url);
const settings = (vars) => fromLookup((name) => vars[name]);

test("defaults", () => {
  assert.deepEqual(settings({ DATABASE_URL: "postgres://x/db" }), {
    redisUrl: "redis://127.0.0.1:6390/",
    databaseUrl: "postgres://x/db",
    port: 8080,
    readThrough: true,
    waitMs: null,
    leaseMs: 30000,
    poolSize: 16,
    processorDelayMs: 0,
    fence: true,
    backend: "auto",
    redisTls: { ca: null, cert: null, key: null },
    tokens: new Map([
      ["tok_demo", "acct_demo"],
      ["tok_a", "acct_a"],
      ["tok_b", "acct_b"],
    ]),
  });
});

test("API_TOKENS maps bearer tokens to accounts; bad tables are refused", () => {
  const s = settings({ DATABASE_URL: "x", API_TOKENS: " t1=acct_1, t2 = acct_2 ," });
  assert.deepEqual([...s.tokens], [["t1", "acct_1"], ["t2", "acct_2"]]);
  for (const bad of ["t1", "=acct", "t1=", "a=1,a=2", ",", ""]) {
    assert.throws(() => settings({ DATABASE_URL: "x", API_TOKENS: bad }), SettingsError, bad);
  }
  assert.equal(parseTokens("a=b").get("a"), "b");
});

test("overrides", () => {
  const s = settings({
    DATABASE_URL: "x", PORT: "9000", READ_THROUGH: "off", WAIT_MS: "5000", FENCE: "0", LEASE_MS: "+250",
    PG_POOL_SIZE: "4", PROCESSOR_DELAY_MS: "100", REDIS_URL: "redis://h:1/",
  });
  assert.equal(s.port, 9000);
  assert.equal(s.readThrough, false);
  assert.equal(s.fence, false);
  assert.equal(s.waitMs, 5000);
  assert.equal(s.leaseMs, 250);
  assert.equal(s.poolSize, 4);
  assert.equal(s.processorDelayMs, 100);
  assert.equal(s.redisUrl, "redis://h:1/");
  assert.equal(settings({ DATABASE_URL: "x", WAIT_MS: "0" }).waitMs, null, "a wait of 0 is no wait");
  for (const on of ["1", "true", "on"]) assert.equal(settings({ DATABASE_URL: "x", FENCE: on }).fence, true);
  for (const b of ["auto", "module", "functions", "scripts"]) assert.equal(settings({ DATABASE_URL: "x", BACKEND: b }).backend, b);
  assert.deepEqual(
    settings({ DATABASE_URL: "x", REDIS_URL: "rediss://h/", REDIS_CA_CERT: "ca.pem", REDIS_CLIENT_CERT: "c.pem", REDIS_CLIENT_KEY: "k.pem" }).redisTls,
    { ca: "ca.pem", cert: "c.pem", key: "k.pem" },
  );
});

test("bad values are refused, naming the variable as the Rust service does", () => {
  const cases = [
    [{}, "DATABASE_URL is not set"],
    [{ PORT: "http" }, 'PORT="http" is not a port'],
    [{ PORT: "70000" }, 'PORT="70000" is not a port'],
    [{ READ_THROUGH: "maybe" }, 'READ_THROUGH="maybe": use on or off'],
    [{ FENCE: "maybe" }, 'FENCE="maybe": use on or off'],
    [{ WAIT_MS: "soon" }, 'WAIT_MS="soon" is not a number of milliseconds'],
    [{ LEASE_MS: "-1" }, 'LEASE_MS="-1" is not a number of milliseconds'],
    [{ PROCESSOR_DELAY_MS: "1.5" }, 'PROCESSOR_DELAY_MS="1.5" is not a number of milliseconds'],
    [{ PG_POOL_SIZE: "many" }, 'PG_POOL_SIZE="many"'],
    [{ BACKEND: "lua" }, 'BACKEND="lua": use auto, module, functions, scripts'],
    [{ REDIS_URL: "rediss://h/", REDIS_CLIENT_CERT: "c.pem" }, "REDIS_CLIENT_CERT and REDIS_CLIENT_KEY go together"],
    [{ REDIS_CA_CERT: "ca.pem" }, "REDIS_CA_CERT needs a rediss:// REDIS_URL"],
  ];
  for (const [vars, message] of cases) {
    const env = Object.keys(vars).length === 0 ? {} : { DATABASE_URL: "x", ...vars };
    assert.throws(() => settings(env), (err) => err.message.includes(message), message);
  }
});

test("the payments DDL is the Rust example's, and the advisory locks are the writer's and the example's", () => {
  const rustDb = readFileSync(new URL("examples/payments-api/src/db.rs", REPO), "utf8");
  const rustProcessor = readFileSync(new URL("examples/payments-api/src/processor.rs", REPO), "utf8");
  // The writer's migrations module, wherever it lives in the crate.
  const writerSrc = new URL("crates/idem-writer/src/", REPO);
  const writer = readdirSync(writerSrc, { recursive: true })
    .filter((f) => f.endsWith(".rs"))
    .map((f) => readFileSync(new URL(f, writerSrc), "utf8"))
    .find((text) => text.includes("MIGRATION_LOCK_ID"));
  assert.ok(writer !== undefined, "the writer's migrations module");
  assert.ok(rustDb.includes(`"${db.CREATE_PAYMENTS}"`), "CREATE_PAYMENTS differs from examples/payments-api/src/db.rs");
  assert.ok(rustProcessor.includes(`"${db.CREATE_CHARGES}"`), "CREATE_CHARGES differs from examples/payments-api/src/processor.rs");
  const hex = (n) => "0x" + BigInt(n).toString(16).match(/.{4}/g).join("_");
  assert.ok(writer.includes(`MIGRATION_LOCK_ID: i64 = ${hex(db.WRITER_MIGRATION_LOCK)};`), hex(db.WRITER_MIGRATION_LOCK));
  assert.ok(rustDb.includes(`MIGRATION_LOCK_ID: i64 = ${hex(db.MIGRATION_LOCK)};`), hex(db.MIGRATION_LOCK));
  const versions = [...writer.matchAll(/version: (\d+),\s+name: "([a-z_]+)",\s+sql: include_str!\("(?:\.\.\/)+migrations\/(\d{4})_([a-z_]+)\.sql"\)/g)];
  assert.ok(versions.length >= 3);
  for (const [, version, name, fileVersion, fileName] of versions) {
    assert.equal(Number(fileVersion), Number(version), "a migration file's number is its version");
    assert.equal(fileName, name, "a migration file's name is its recorded name");
  }
});
