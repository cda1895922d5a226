// The shared vectors in spec/vectors/ (the same files the Rust crate's
// tests/spec_vectors.rs and the Python tests hold their implementations to),
// the error codes of spec/errors.json, and the spec files the package ships.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { ErrorReply } from "@redis/client";
import * as idem from "../dist/index.js";
import { wire } from "../dist/index.js";
import { SPEC, REPO, b, loadSpec } from "./helpers.mjs";


test("every vector file is read here", () => {
  const read = ["canonical_json.json", "commands.json", "downstream_key.json", "fingerprint.json", "keys.json", "replies.json", "rfc8785.json"];
  assert.deepEqual(readdirSync(join(SPEC, "vectors")).filter((f) => f.endsWith(".json")).sort(), read);
});

test("fingerprints", () => {
  const cases = loadSpec("vectors/fingerprint.json").cases;
  assert.ok(cases.length > 10);
  for (const c of cases) {
    const f = new idem.Fingerprinter({ headers: c.fingerprinter.headers, canonicalJson: c.fingerprinter.canonical_json });
    const headers = c.request.headers.map(([n, v]) => [n, b(v)]);
    const fp = f.fingerprint(c.request.method, c.request.target, headers, b(c.request.body));
    assert.equal(fp.toString("hex"), c.expected.fingerprint, c.name);
    assert.equal(idem.storedHex(fp), c.expected.stored_hex, c.name);
    if (c.expected.body === "canonical") assert.deepEqual(idem.canonicalize(b(c.request.body)), b(c.expected.canonical_body), c.name);
  }
});

test("canonical JSON", () => {
  for (const c of loadSpec("vectors/canonical_json.json").cases) {
    const out = idem.canonicalize(b(c.input));
    assert.deepEqual(out === null ? null : out.toString("utf8"), c.expected, c.name);
  }
});

test("the RFC 8785 corpus", () => {
  const doc = loadSpec("vectors/rfc8785.json");
  for (const c of doc.cases) assert.equal(idem.canonicalize(b(c.input))?.toString("utf8"), c.expected, c.name);
  for (const c of doc.numbers) {
    const value = Buffer.from(c.ieee_hex, "hex").readDoubleBE(0);
    if (c.expected === null) assert.throws(() => idem.formatDouble(value), /JSON cannot carry/);
    else assert.equal(idem.formatDouble(value), c.expected, c.ieee_hex);
  }
});

test("the Idempotency-Key header, tenants and Redis key names", () => {
  const doc = loadSpec("vectors/keys.json");
  const http = loadSpec("http.json");
  for (const c of doc.header) {
    const lines = c.lines.map(b);
    if ("error" in c.expected) {
      assert.throws(() => idem.parseKey(lines), (err) => err instanceof idem.InvalidKeyError && err.kind === c.expected.error && err.detail === http.key_errors[c.expected.error], c.name);
    } else if (c.expected.absent) {
      assert.equal(idem.parseKey(lines), null, c.name);
    } else {
      assert.equal(idem.parseKey(lines), c.expected.key, c.name);
    }
  }
  for (const c of doc.tenant) assert.equal(idem.tenantOfLines(c.lines.map(b)), c.expected, c.name);
  for (const c of doc.redis_key) assert.equal(idem.redisKey(c.prefix, c.tenant, c.key), c.expected, c.name);
  assert.equal(doc.max_key_bytes, idem.MAX_KEY_BYTES);
});

test("tenants with a tenant source: missing, empty and too long are refused (keys.json tenant_check)", () => {
  const doc = loadSpec("vectors/keys.json");
  assert.equal(doc.max_tenant_bytes, idem.MAX_TENANT_BYTES);
  assert.equal(loadSpec("http.json").defaults.max_tenant_bytes, idem.MAX_TENANT_BYTES);
  for (const c of doc.tenant_check) {
    const tenant = "lines" in c ? idem.tenantOfLines(c.lines.map(b)) : c.value;
    if ("error" in c.expected) {
      assert.throws(() => idem.checkTenant(tenant), (err) => err instanceof idem.InvalidTenantError && err.problem === c.expected.error, c.name);
    } else {
      assert.equal(idem.checkTenant(tenant), c.expected.tenant, c.name);
    }
  }
});

test("the downstream key", () => {
  for (const c of loadSpec("vectors/downstream_key.json").cases) assert.equal(idem.downstreamKey(c.key, b(c.fingerprint)), c.expected);
});

/** A frame as this package's node-redis settings hand it over: bulk strings as Buffers, integers as strings. */
function frame(v) {
  const [[kind, value]] = Object.entries(v);
  if (kind === "array") return value.map(frame);
  if (kind === "bulk") return b(value);
  if (kind === "simple") return Buffer.from(value);
  if (kind === "int") return String(value);
  assert.equal(kind, "null");
  return null;
}

function stored(v) {
  return { status: v.status, body: b(v.body), headers: v.headers.map(([n, x]) => [n, b(x)]) };
}

function outcome(v) {
  if ("new" in v) return { kind: "new", token: BigInt(v.new.token) };
  if ("in_flight" in v) return { kind: "in_flight", retryAfterMs: v.in_flight.retry_after_ms };
  if ("replay" in v) return { kind: "replay", response: stored(v.replay) };
  assert.ok("mismatch" in v);
  return { kind: "mismatch" };
}

function record(v) {
  const common = { fingerprintHex: v.fingerprint_hex, token: BigInt(v.token), createdAt: v.created_at, expiresAt: v.expires_at };
  if (v.state === "in_progress") return { state: "in_progress", ...common, leaseUntil: v.lease_until };
  return { state: "completed", ...common, response: stored(v), completedAt: v.completed_at, mirror: v.mirror };
}

test("reply layouts", () => {
  const doc = loadSpec("vectors/replies.json");
  for (const c of doc.begin) {
    assert.deepEqual(wire.parseBegin(frame(c.fields)), outcome(c.outcome), c.name);
    assert.deepEqual(wire.parseBegin(frame(c.packed)), outcome(c.outcome), c.name);
  }
  for (const c of doc.begin_equivalent) assert.deepEqual(wire.parseBegin(frame(c.reply)), outcome(c.outcome), c.name);
  for (const c of doc.begin_invalid) assert.throws(() => wire.parseBegin(frame(c.reply)), idem.UnexpectedReplyError, c.name);
  for (const c of doc.get) assert.deepEqual(wire.parseRecord(frame(c.reply)), c.record === null ? null : record(c.record), c.name);
  for (const c of doc.pull) {
    const expected = c.records.map((r) => ({
      key: b(r.key), token: BigInt(r.token), fingerprintHex: r.fingerprint_hex, response: stored(r),
      createdAt: r.created_at, completedAt: r.completed_at, expiresAt: r.expires_at,
    }));
    assert.deepEqual(wire.parsePull(frame(c.reply)), expected, c.name);
  }
  assert.equal(wire.parseOk(frame(doc.complete.reply)), undefined);
  for (const c of doc.abort) assert.equal(wire.parseAbort(frame(c.reply)), c.released);
  for (const c of doc.touch) assert.equal(wire.parseTouch(frame(c.reply)), c.remaining_ms);
  assert.throws(() => wire.parseAbort(Buffer.from("OK")), idem.UnexpectedReplyError);
  assert.throws(() => wire.parseTouch("-1"), idem.UnexpectedReplyError);
});

test("commands as sent", () => {
  const doc = loadSpec("vectors/commands.json");
  const args = (v) => v.map(b);
  const sent = (v) => v.map((a) => (typeof a === "string" ? Buffer.from(a) : a));
  for (const c of doc.ttl_secs) assert.equal(wire.ttlSecs(c.us / 1000), c.secs, `ttl ${c.us}`);
  for (const c of doc.client_ms) assert.equal(wire.clientMs(c.us / 1000), c.ms, `ms ${c.us}`);
  for (const c of doc.begin) {
    const got = wire.beginArgs(b(c.key), b(c.fingerprint), c.ttl_secs * 1000, {
      leaseMs: c.lease_ms ?? undefined, waitMs: c.wait_ms ?? undefined, packed: c.packed,
    });
    assert.deepEqual(sent(got), args(c.args));
  }
  for (const c of doc.complete) {
    const response = { status: c.status, body: b(c.body), headers: c.headers.map(([n, v]) => [n, b(v)]) };
    assert.deepEqual(sent(wire.completeArgs(b(c.key), BigInt(c.token), response, c.mirrored)), args(c.args));
  }
  for (const c of doc.abort) assert.deepEqual(sent(wire.abortArgs(b(c.key), BigInt(c.token))), args(c.args));
  for (const c of doc.touch) assert.deepEqual(sent(wire.touchArgs(b(c.key), BigInt(c.token), c.lease_ms)), args(c.args));
  for (const c of doc.get) assert.deepEqual(sent(wire.getArgs(b(c.key))), args(c.args));
});

test("every module code has its class, and Redis errors are classified as spec/errors.json says", () => {
  const spec = loadSpec("errors.json");
  assert.deepEqual([...idem.MODULE_ERRORS.keys()], spec.module_codes.map((c) => c.code));
  for (const entry of spec.module_codes) {
    const err = idem.fromRedis(new ErrorReply(`${entry.code} some detail`));
    assert.equal(err.constructor.name, `${entry.name}Error`);
    assert.equal(idem[`${entry.name}Error`], err.constructor);
    assert.equal(err.code, entry.code);
    assert.equal(err.detail, "some detail");
    assert.ok(err instanceof idem.ModuleError);
    assert.equal(err.isTransient, spec.transient_codes.includes(entry.code));
    assert.equal(err.isUnavailable, false);
  }
  for (const code of spec.unavailable_codes) {
    const err = idem.fromRedis(new ErrorReply(`${code} not now`));
    assert.ok(err instanceof idem.UnavailableError, code);
    assert.ok(err.isUnreachable && err.isUnavailable && err.isTransient);
  }
  for (const code of spec.writes_refused_codes) {
    const err = idem.fromRedis(new ErrorReply(`${code} not now`));
    assert.ok(err instanceof idem.WritesRefusedError, code);
    assert.ok(err.isUnavailable && !err.isUnreachable && err.isTransient);
  }
  for (const code of spec.configuration_codes) {
    const err = idem.fromRedis(new ErrorReply(`${code} refused`));
    assert.ok(err instanceof idem.OtherRedisError, code);
    assert.equal(err.isTransient, false);
  }
  const other = idem.fromRedis(new ErrorReply("ERR unknown command"));
  assert.ok(other instanceof idem.OtherRedisError && !other.isUnavailable);
  assert.ok(idem.fromRedis(Object.assign(new Error("connect ECONNREFUSED"), { code: "ECONNREFUSED" })) instanceof idem.UnavailableError);
  assert.ok(wire.refusesPacked(idem.fromRedis(new ErrorReply(`BADARG ${spec.packed_refused_detail}`))));
  assert.ok(!wire.refusesPacked(idem.fromRedis(new ErrorReply("BADARG unknown option 'X'"))));
});

test("problem bodies and Retry-After follow spec/http.json", () => {
  const http = loadSpec("http.json");
  for (const c of http.in_flight_retry_after.cases) assert.equal(idem.retryAfterHeader(c.retry_after_ms), c.header);
  for (const [name, p] of Object.entries(http.problems)) {
    const body = JSON.parse(idem.problemBody(name).toString());
    assert.deepEqual(body, { type: p.type, title: p.title, status: p.status, detail: p.detail });
    assert.equal(idem.problem(name).status, p.status);
  }
  for (const s of [200, 201, 400, 404, 409, 422, 499]) assert.equal(idem.defaultStorePolicy(s), true, String(s));
  for (const s of [429, 500, 503, 599]) assert.equal(idem.defaultStorePolicy(s), false, String(s));
});

test("the package ships the repository's spec files, copied at build time", () => {
  for (const name of ["errors.json", "http.json", "read_through.json", "fence.json", "functions.json", "outbox_slots.json"]) {
    assert.deepEqual(readFileSync(join(REPO, "clients/node/spec", name)), readFileSync(join(SPEC, name)), name);
  }
  // The Functions library, which the client loads where the module is not.
  assert.deepEqual(readFileSync(join(REPO, "clients/node/functions/idem.lua")), readFileSync(join(REPO, "functions/idem.lua")));
  assert.equal(idem.spec.libraryPath().pathname, join(REPO, "clients/node/functions/idem.lua"));
  const pack = JSON.parse(readFileSync(join(REPO, "clients/node/package.json"), "utf8"));
  assert.ok(pack.files.includes("spec"));
  assert.ok(pack.files.includes("functions"));
});
