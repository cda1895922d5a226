// The Idempotency-Key header (a structured-field string such as "abc" or a
// bare token such as abc), tenants, and the Redis key derived from both
// (spec/vectors/keys.json).
import * as spec from "./spec.js";

/** Longest key accepted, in bytes (after unquoting). */
export const MAX_KEY_BYTES = 255;

/**
 * Longest tenant accepted, in bytes (its UTF-8; spec/http.json defaults.max_tenant_bytes): with MAX_KEY_BYTES every
 * Redis key the middleware makes stays under the 2,048 bytes the writer's mirror takes.
 */
export const MAX_TENANT_BYTES = 128;

export type KeyErrorKind = "empty" | "too_long" | "malformed" | "repeated";
export type TenantProblem = "missing_tenant" | "invalid_tenant";

/** A configured tenant source gave no tenant or an empty one (missing_tenant), or one over MAX_TENANT_BYTES (invalid_tenant). */
export class InvalidTenantError extends Error {
  readonly problem: TenantProblem;
  constructor(problem: TenantProblem) {
    super(spec.http().problems[problem].detail ?? problem);
    this.name = "InvalidTenantError";
    this.problem = problem;
  }
}

/**
 * The tenant a configured source gave, checked: absent and empty are refused (they would share the anonymous scope),
 * and so is one longer than MAX_TENANT_BYTES; throws InvalidTenantError.
 */
export function checkTenant(tenant: string | null | undefined): string {
  if (tenant === null || tenant === undefined || tenant === "") throw new InvalidTenantError("missing_tenant");
  if (Buffer.byteLength(tenant, "utf8") > MAX_TENANT_BYTES) throw new InvalidTenantError("invalid_tenant");
  return tenant;
}

/** Why an Idempotency-Key header was rejected; `detail` is the 400 problem's detail (spec/http.json). */
export class InvalidKeyError extends Error {
  readonly kind: KeyErrorKind;
  readonly detail: string;
  constructor(kind: KeyErrorKind) {
    const detail = spec.http().key_errors[kind];
    super(detail);
    this.name = "InvalidKeyError";
    this.kind = kind;
    this.detail = detail;
  }
}

/** Every line of the header field (as raw bytes); null when absent. More than one line is refused. */
export function parseKey(lines: readonly Uint8Array[]): string | null {
  if (lines.length === 0) return null;
  if (lines.length > 1) throw new InvalidKeyError("repeated");
  return parseValue(lines[0] as Uint8Array);
}

/** One header value: "sf-string" (with \" and \\ escapes) or a bare run of visible ASCII without quotes, commas, semicolons or backslashes. */
export function parseValue(raw: Uint8Array): string {
  let start = 0;
  let end = raw.length;
  while (start < end && (raw[start] === 0x20 || raw[start] === 0x09)) start++;
  while (end > start && (raw[end - 1] === 0x20 || raw[end - 1] === 0x09)) end--;
  const value = raw.subarray(start, end);
  if (value.length === 0) throw new InvalidKeyError("empty");
  const key = value[0] === 0x22 ? unquote(value) : bare(value);
  if (key.length === 0) throw new InvalidKeyError("empty");
  if (Buffer.byteLength(key) > MAX_KEY_BYTES) throw new InvalidKeyError("too_long");
  return key;
}

function unquote(value: Uint8Array): string {
  const out: string[] = [];
  let i = 1;
  for (;;) {
    if (i >= value.length) throw new InvalidKeyError("malformed");
    const c = value[i++] as number;
    if (c === 0x22) break;
    if (c === 0x5c) {
      const next = value[i];
      if (next !== 0x22 && next !== 0x5c) throw new InvalidKeyError("malformed");
      out.push(String.fromCharCode(next));
      i++;
    } else if (c >= 0x20 && c <= 0x7e) {
      out.push(String.fromCharCode(c));
    } else {
      throw new InvalidKeyError("malformed");
    }
  }
  if (i !== value.length) throw new InvalidKeyError("malformed");
  return out.join("");
}

function bare(value: Uint8Array): string {
  for (const c of value) {
    if (c < 0x21 || c > 0x7e || c === 0x22 || c === 0x2c || c === 0x3b || c === 0x5c) throw new InvalidKeyError("malformed");
  }
  return Buffer.from(value).toString("ascii");
}

/**
 * A tenant header's lines as one tenant, combined as HTTP combines them (`a, b`); a value that is not UTF-8
 * becomes NUL plus its bytes in hex, a tenant no other value can name. null when the header is absent.
 */
export function tenantOfLines(lines: readonly Uint8Array[]): string | null {
  if (lines.length === 0) return null;
  const combined = Buffer.concat(lines.flatMap((line, i) => (i === 0 ? [line] : [Buffer.from(", "), line])));
  try {
    return new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(combined);
  } catch {
    return "\0" + combined.toString("hex");
  }
}

/**
 * prefix{tenant:key} with %, :, {, } and bytes outside visible ASCII percent-encoded in both parts: two
 * tenants never share a key, and the hash tag is the whole pair.
 */
export function redisKey(prefix: string, tenant: string, key: string): string {
  return `${prefix}{${encode(tenant)}:${encode(key)}}`;
}

function encode(part: string): string {
  let out = "";
  for (const b of Buffer.from(part, "utf8")) {
    if (b >= 0x21 && b <= 0x7e && b !== 0x25 && b !== 0x3a && b !== 0x7b && b !== 0x7d) out += String.fromCharCode(b);
    else out += `%${b.toString(16).toUpperCase().padStart(2, "0")}`;
  }
  return out;
}
