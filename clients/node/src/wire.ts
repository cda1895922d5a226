// The module's wire protocol, as spec/vectors/commands.json and replies.json
// describe it: the commands a client sends (argument order, duration
// rounding) and strict readers of the replies (IDEM.BEGIN in both layouts,
// IDEM.GET, IDEM.MIRROR.PULL, and the small ones). Replies arrive with bulk
// and simple strings as Buffers and integers as decimal strings (no
// precision lost); anything without the documented shape throws
// UnexpectedReplyError.
import { inspect } from "node:util";
import * as spec from "./spec.js";
import { BadArgError, UnexpectedReplyError } from "./errors.js";
import type { KeyRecord, Outcome, PulledRecord, StoredResponse } from "./types.js";

export const STATUS_MIN = 100;
export const STATUS_MAX = 599;
const TRAILER = 10;
const NO_EXPIRY = -1n;
const MAX_TOKEN = 1n << 63n;

export type Arg = string | Buffer;

function micros(ms: number): number {
  if (!Number.isFinite(ms) || ms < 0) throw new RangeError(`a duration must be finite and not negative: ${ms}`);
  return Math.ceil(Math.round(ms * 1_000_000) / 1000);
}

/** A TTL in ms as IDEM.BEGIN's ttl-seconds: whole seconds rounded up, at least 1. */
export function ttlSecs(ms: number): number {
  return Math.max(1, Math.ceil(micros(ms) / 1_000_000));
}

/** A lease, wait or TOUCH lease in ms as whole milliseconds rounded up, at least 1. */
export function clientMs(ms: number): number {
  return Math.max(1, Math.ceil(micros(ms) / 1000));
}

export function isZero(ms: number | undefined): boolean {
  return ms === undefined || micros(ms) === 0;
}

export function checkToken(token: bigint): void {
  if (token <= 0n || token >= MAX_TOKEN) throw new RangeError(`a token is positive and below 2^63: ${token}`);
}

/** IDEM.BEGIN key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]. */
export function beginArgs(
  key: Arg,
  fingerprint: Buffer,
  ttlMs: number,
  opts: { leaseMs?: number | undefined; waitMs?: number | undefined; packed?: boolean } = {},
): Arg[] {
  const args: Arg[] = ["IDEM.BEGIN", key, fingerprint, String(ttlSecs(ttlMs))];
  if (opts.leaseMs !== undefined) args.push("LEASE", String(clientMs(opts.leaseMs)));
  if (!isZero(opts.waitMs)) args.push("WAIT", String(clientMs(opts.waitMs ?? 0)));
  if (opts.packed === true) args.push("PACKED");
  return args;
}

/** IDEM.COMPLETE key token status body [HEADER name value]... [MIRRORED]. */
export function completeArgs(key: Arg, token: bigint, response: StoredResponse, mirrored = false): Arg[] {
  checkToken(token);
  const args: Arg[] = ["IDEM.COMPLETE", key, token.toString(), String(response.status), response.body];
  for (const [name, value] of response.headers) args.push("HEADER", name, value);
  if (mirrored) args.push("MIRRORED");
  return args;
}

export function abortArgs(key: Arg, token: bigint): Arg[] {
  return ["IDEM.ABORT", key, token.toString()];
}

export function touchArgs(key: Arg, token: bigint, leaseMs: number): Arg[] {
  return ["IDEM.TOUCH", key, token.toString(), String(clientMs(leaseMs))];
}

export function getArgs(key: Arg): Arg[] {
  return ["IDEM.GET", key];
}

// ---------------------------------------------------------------- readers

const bad = (what: string): UnexpectedReplyError => new UnexpectedReplyError(what);

function show(v: unknown): string {
  return inspect(Buffer.isBuffer(v) ? v.toString("latin1") : v, { depth: 4, breakLength: Infinity });
}

function bytes(v: unknown, what: string): Buffer {
  if (Buffer.isBuffer(v)) return v;
  if (v instanceof Uint8Array) return Buffer.from(v);
  throw bad(`${what} is not a string: ${show(v)}`);
}

function text(v: unknown, what: string): string {
  const b = bytes(v, what);
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(b);
  } catch {
    throw bad(`${what} is not UTF-8`);
  }
}

function int(v: unknown, what: string): bigint {
  if (typeof v === "bigint") return v;
  if (typeof v === "number" && Number.isSafeInteger(v)) return BigInt(v);
  if (typeof v === "string" || Buffer.isBuffer(v)) {
    const s = typeof v === "string" ? v : v.toString("latin1");
    if (/^-?[0-9]+$/.test(s)) return BigInt(s);
  }
  throw bad(`${what} is not an integer: ${show(v)}`);
}

function uint(v: unknown, what: string): bigint {
  const n = int(v, what);
  if (n < 0n) throw bad(`${what} is negative`);
  return n;
}

function small(n: bigint, what: string): number {
  if (n > BigInt(Number.MAX_SAFE_INTEGER)) throw bad(`${what} ${n} is too large`);
  return Number(n);
}

function positive(v: unknown, what: string): bigint {
  const n = int(v, what);
  if (n <= 0n) throw bad(`${what} ${n} is not positive`);
  return n;
}

function array(v: unknown, what: string): unknown[] {
  if (Array.isArray(v)) return v;
  throw bad(`${what} is not an array: ${show(v)}`);
}

function status(v: unknown): number {
  const s = int(v, "status");
  if (s < BigInt(STATUS_MIN) || s > BigInt(STATUS_MAX)) throw bad(`status ${s} out of range`);
  return Number(s);
}

function headers(v: unknown): [string, Buffer][] {
  if (v === null || v === undefined) return [];
  const items = array(v, "headers");
  if (items.length % 2 !== 0) throw bad("headers: odd number of items");
  const out: [string, Buffer][] = [];
  for (let i = 0; i < items.length; i += 2) {
    out.push([bytes(items[i], "header name").toString("utf8"), bytes(items[i + 1], "header value")]);
  }
  return out;
}

function expiry(v: unknown): number | null {
  const at = int(v, "expires_at");
  if (at === NO_EXPIRY) return null;
  if (at < 0n) throw bad("expires_at is negative");
  return small(at, "expires_at");
}

function fingerprintHex(v: unknown): string {
  const t = text(v, "fingerprint");
  if (!/^[0-9a-fA-F]{64}$/.test(t)) throw bad(`fingerprint is not 32 bytes of hex: ${JSON.stringify(t)}`);
  return t.toLowerCase();
}

/** A PACKED replay: body | (name-len name value-len value)... | status (2) | header-count (4) | body-len (4), big-endian. */
export function unpack(packed: Buffer): StoredResponse {
  const fieldsEnd = packed.length - TRAILER;
  if (fieldsEnd < 0) throw bad("packed replay: shorter than its trailer");
  const st = packed.readUInt16BE(fieldsEnd);
  const count = packed.readUInt32BE(fieldsEnd + 2);
  const bodyLen = packed.readUInt32BE(fieldsEnd + 6);
  if (st < STATUS_MIN || st > STATUS_MAX) throw bad(`packed replay: status ${st} out of range`);
  if (bodyLen > fieldsEnd) throw bad("packed replay: body runs past the headers");
  if (count > Math.floor((fieldsEnd - bodyLen) / 8)) throw bad("packed replay: more headers than bytes");
  let at = bodyLen;
  const hs: [string, Buffer][] = [];
  for (let i = 0; i < count; i++) {
    const pair: Buffer[] = [];
    for (const what of ["name", "value"]) {
      if (at + 4 > fieldsEnd) throw bad(`packed replay: header ${what} cut short`);
      const length = packed.readUInt32BE(at);
      const end = at + 4 + length;
      if (end > fieldsEnd) throw bad(`packed replay: header ${what} cut short`);
      pair.push(packed.subarray(at + 4, end));
      at = end;
    }
    hs.push([(pair[0] as Buffer).toString("utf8"), Buffer.from(pair[1] as Buffer)]);
  }
  if (at !== fieldsEnd) throw bad("packed replay: bytes left after the headers");
  return { status: st, body: Buffer.from(packed.subarray(0, bodyLen)), headers: hs };
}

/** An IDEM.BEGIN reply, in either layout. */
export function parseBegin(reply: unknown): Outcome {
  const items = array(reply, "BEGIN reply");
  if (items.length === 0) throw bad("empty BEGIN reply");
  const tag = text(items[0], "BEGIN outcome");
  const rest = items.slice(1);
  if (tag === "new" && rest.length === 1) {
    const token = positive(rest[0], "token");
    if (token >= MAX_TOKEN) throw bad(`token ${token} is too large`);
    return { kind: "new", token };
  }
  if (tag === "in_flight" && rest.length === 1) {
    return { kind: "in_flight", retryAfterMs: small(positive(rest[0], "retry_after"), "retry_after") };
  }
  if (tag === "replay" && rest.length === 1) return { kind: "replay", response: unpack(bytes(rest[0], "packed replay")) };
  if (tag === "replay" && rest.length === 3) {
    return { kind: "replay", response: { status: status(rest[0]), body: bytes(rest[1], "body"), headers: headers(rest[2]) } };
  }
  if (tag === "mismatch" && rest.length === 0) return { kind: "mismatch" };
  throw bad(`BEGIN outcome ${JSON.stringify(tag)} with ${rest.length} fields`);
}

export function parseOk(reply: unknown): void {
  const ok = Buffer.isBuffer(reply) && reply.toString() === "OK";
  if (!ok) throw bad(`expected OK: ${show(reply)}`);
}

/** IDEM.ABORT: true when released, false when the token no longer held an in-progress record. */
export function parseAbort(reply: unknown): boolean {
  if (typeof reply === "string" || typeof reply === "number" || typeof reply === "bigint") {
    const n = String(reply);
    if (n === "1") return true;
    if (n === "0") return false;
  }
  throw bad(`ABORT reply: ${show(reply)}`);
}

/** IDEM.TOUCH: the remaining lease in ms. */
export function parseTouch(reply: unknown): number {
  if (Buffer.isBuffer(reply)) throw bad(`TOUCH reply: ${show(reply)}`);
  return small(uint(reply, "TOUCH reply"), "TOUCH reply");
}

const IN_PROGRESS = ["state", "fingerprint", "token", "created_at", "expires_at", "lease_until"];
const COMPLETED = ["state", "fingerprint", "token", "created_at", "expires_at", "status", "body", "headers", "completed_at", "mirror"];

/** An IDEM.GET reply, strictly: the documented fields in order; null when no record. */
export function parseRecord(reply: unknown): KeyRecord | null {
  if (reply === null || reply === undefined) return null;
  const items = array(reply, "IDEM.GET reply");
  if (items.length % 2 !== 0 || items.length < 2 * IN_PROGRESS.length) throw bad("IDEM.GET reply has too few fields");
  const names: string[] = [];
  const values: unknown[] = [];
  for (let i = 0; i < items.length; i += 2) {
    names.push(text(items[i], "field name"));
    values.push(items[i + 1]);
  }
  const state = text(values[0], "state");
  const common = {
    fingerprintHex: fingerprintHex(values[1]),
    token: uint(values[2], "token"),
    createdAt: small(uint(values[3], "created_at"), "created_at"),
    expiresAt: expiry(values[4]),
  };
  const same = (want: string[]): boolean => names.length === want.length && names.every((n, i) => n === want[i]);
  if (state === "in_progress" && same(IN_PROGRESS)) {
    return { state, ...common, leaseUntil: small(uint(values[5], "lease_until"), "lease_until") };
  }
  if (state === "completed" && same(COMPLETED)) {
    const mirror = text(values[9], "mirror");
    if (mirror !== "pending" && mirror !== "mirrored") throw bad(`mirror ${JSON.stringify(mirror)}`);
    return {
      state,
      ...common,
      response: { status: status(values[5]), body: bytes(values[6], "body"), headers: headers(values[7]) },
      completedAt: small(uint(values[8], "completed_at"), "completed_at"),
      mirror,
    };
  }
  throw bad(`IDEM.GET state ${JSON.stringify(state)} with fields ${JSON.stringify(names)}`);
}

/** An IDEM.MIRROR.PULL reply; each entry read on its own, so one malformed entry (returned as its error) does not hide the others. */
export function parsePull(reply: unknown): (PulledRecord | UnexpectedReplyError)[] {
  return array(reply, "PULL reply").map((entry) => {
    try {
      const f = array(entry, "PULL entry");
      if (f.length !== 9) throw bad(`PULL entry has ${f.length} fields`);
      return {
        key: bytes(f[0], "key"),
        token: uint(f[1], "token"),
        fingerprintHex: fingerprintHex(f[2]),
        response: { status: status(f[3]), body: bytes(f[4], "body"), headers: headers(f[5]) },
        createdAt: small(uint(f[6], "created_at"), "created_at"),
        completedAt: small(uint(f[7], "completed_at"), "completed_at"),
        expiresAt: expiry(f[8]),
      };
    } catch (err) {
      if (err instanceof UnexpectedReplyError) return err;
      throw err;
    }
  });
}

/** Whether a BADARG is a module from before PACKED refusing it. */
export function refusesPacked(err: unknown): boolean {
  return err instanceof BadArgError && err.detail === spec.errors().packed_refused_detail;
}
