// What IDEM.BEGIN decided, the stored response a replay hands back, and the
// record IDEM.GET shows.

/** A response as IDEM.COMPLETE stores it; header names may repeat, in order. */
export interface StoredResponse {
  status: number;
  body: Buffer;
  headers: [name: string, value: Buffer][];
}

/** A stored response from text or bytes. */
export function storedResponse(
  status: number,
  body: string | Uint8Array = "",
  headers: Iterable<[string, string | Uint8Array]> = [],
): StoredResponse {
  const bytes = (v: string | Uint8Array): Buffer => (typeof v === "string" ? Buffer.from(v) : Buffer.from(v));
  return { status, body: bytes(body), headers: [...headers].map(([n, v]) => [n, bytes(v)]) };
}

/** No record (or a takeover of a lapsed lease): the caller holds the key with `token`. */
export interface New {
  kind: "new";
  token: bigint;
}
/** Another holder's lease is alive; try again after `retryAfterMs`. */
export interface InFlight {
  kind: "in_flight";
  retryAfterMs: number;
}
/** The key was completed: answer with the stored response. */
export interface Replay {
  kind: "replay";
  response: StoredResponse;
}
/** The key exists with another request fingerprint. */
export interface Mismatch {
  kind: "mismatch";
}
/** The module's decision for one IDEM.BEGIN. */
export type Outcome = New | InFlight | Replay | Mismatch;

/** Where a completed response came from: the handler (the writer mirrors it) or Postgres (stored MIRRORED). */
export type Origin = "handler" | "mirror";

/** An IDEM.GET answer. Times are Unix milliseconds; `expiresAt` is null for a key without TTL. */
export type KeyRecord =
  | {
      state: "in_progress";
      fingerprintHex: string;
      token: bigint;
      createdAt: number;
      expiresAt: number | null;
      leaseUntil: number;
    }
  | {
      state: "completed";
      fingerprintHex: string;
      token: bigint;
      createdAt: number;
      expiresAt: number | null;
      response: StoredResponse;
      completedAt: number;
      mirror: "pending" | "mirrored";
    };

/** One record of an IDEM.MIRROR.PULL answer. */
export interface PulledRecord {
  key: Buffer;
  token: bigint;
  fingerprintHex: string;
  response: StoredResponse;
  createdAt: number;
  completedAt: number;
  expiresAt: number | null;
}

/** Options of one IDEM.BEGIN, in milliseconds. */
export interface BeginOptions {
  /** How long the key lives (sent as whole seconds, rounded up, at least 1). */
  ttlMs: number;
  /** The holder's lease; undefined uses the module's lease-ms config. */
  leaseMs?: number | undefined;
  /** Wait up to this long for the holder's answer instead of in_flight. */
  waitMs?: number | undefined;
}
