// Request fingerprints, exactly as the Rust client's Fingerprinter computes
// them (spec/vectors/fingerprint.json): SHA-256 over a length-prefixed
// framing of a version tag, the method, the request target (path and query
// as sent), each configured header (name, count of values, each value) and
// the body, tagged raw or canonical JSON. Also the fence's downstream key.
import { createHash, type Hash } from "node:crypto";
import { canonicalize } from "./canonicalJson.js";

const FRAMING_TAG = Buffer.from("idem-fingerprint-v1");
const BODY_RAW = Buffer.from([0]);
const BODY_CANONICAL_JSON = Buffer.from([1]);

/** Request headers as (name, value) pairs in request order; a string value is taken as Latin-1 (its bytes as sent). */
export type HeaderPairs = Iterable<readonly [string | Uint8Array, string | Uint8Array]>;

const latin1 = (s: string | Uint8Array): Buffer => (typeof s === "string" ? Buffer.from(s, "latin1") : Buffer.from(s));

/** Lowercase hex SHA-256 of fingerprint bytes: what the module and the Postgres mirror keep. */
export function storedHex(fingerprint: Uint8Array): string {
  return createHash("sha256").update(fingerprint).digest("hex");
}

/** Which parts of a request go into its fingerprint (method, target and body always). */
export interface FingerprinterOptions {
  /** Header names whose values (all, in order; absent and empty differ) enter the fingerprint. */
  headers?: readonly string[];
  /** Canonicalize JSON bodies (application/json or * /*+json) so member order and whitespace do not matter. */
  canonicalJson?: boolean;
}

export class Fingerprinter {
  readonly headers: readonly Buffer[];
  readonly canonicalJson: boolean;

  constructor(options: FingerprinterOptions = {}) {
    const names: string[] = [];
    for (const name of options.headers ?? []) {
      const lowered = name.toLowerCase();
      if (!names.includes(lowered)) names.push(lowered);
    }
    this.headers = names.map((n) => Buffer.from(n, "ascii"));
    this.canonicalJson = options.canonicalJson ?? false;
  }

  /** The 32 bytes sent to IDEM.BEGIN; `target` is the path and query as sent (`/payments?x=1`). */
  fingerprint(method: string, target: string | Uint8Array, headers: HeaderPairs, body: Uint8Array): Buffer {
    const pairs = [...headers].map(([n, v]) => [Buffer.from(latin1(n).toString("latin1").toLowerCase(), "latin1"), latin1(v)] as const);
    const h = createHash("sha256").update(FRAMING_TAG);
    field(h, Buffer.from(method, "ascii"));
    field(h, typeof target === "string" ? Buffer.from(target, "utf8") : Buffer.from(target));
    count(h, this.headers.length);
    for (const name of this.headers) {
      const values = pairs.filter(([n]) => n.equals(name)).map(([, v]) => v);
      field(h, name);
      count(h, values.length);
      for (const value of values) field(h, value);
    }
    const canonical = this.canonicalBody(pairs, body);
    if (canonical === null) {
      h.update(BODY_RAW);
      field(h, body);
    } else {
      h.update(BODY_CANONICAL_JSON);
      field(h, canonical);
    }
    return h.digest();
  }

  private canonicalBody(pairs: (readonly [Buffer, Buffer])[], body: Uint8Array): Buffer | null {
    if (!this.canonicalJson) return null;
    const contentType = pairs.find(([n]) => n.toString("latin1") === "content-type")?.[1];
    if (contentType === undefined || !isJsonContentType(contentType)) return null;
    return canonicalize(body);
  }
}

/** application/json or type/subtype+json (case-insensitive, parameters ignored); a value that is not visible ASCII is not read. */
export function isJsonContentType(value: Uint8Array): boolean {
  for (const b of value) if (!(b === 0x09 || (b >= 0x20 && b < 0x7f))) return false;
  const [first = ""] = Buffer.from(value).toString("latin1").split(";", 1);
  const essence = first.replace(/^[ \t]+|[ \t]+$/g, "").toLowerCase();
  return essence === "application/json" || (essence.includes("/") && essence.endsWith("+json"));
}

/**
 * A key for a downstream API's own idempotency (a payment processor's Idempotency-Key): hex SHA-256 over the
 * key and the request fingerprint, the same for every attempt at this request across retries and takeovers;
 * the token is deliberately not part of it (docs/fence.md).
 */
export function downstreamKey(key: string, fingerprint: Uint8Array): string {
  return downstreamKeyOf(key, storedHex(fingerprint));
}

/** downstreamKey from the fingerprint's stored hex. */
export function downstreamKeyOf(key: string, fingerprintHex: string): string {
  const raw = Buffer.from(key, "utf8");
  const len = Buffer.alloc(8);
  len.writeBigUInt64BE(BigInt(raw.length));
  return createHash("sha256").update(len).update(raw).update(fingerprintHex, "ascii").digest("hex");
}

function count(h: Hash, n: number): void {
  const b = Buffer.alloc(8);
  b.writeBigUInt64BE(BigInt(n));
  h.update(b);
}

function field(h: Hash, b: Uint8Array): void {
  count(h, b.length);
  h.update(b);
}
