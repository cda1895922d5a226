// Read-through from the writer's Postgres mirror (spec/read_through.json):
// when Redis answers new for a key the mirror still holds as completed,
// Redis lost it; Redis is refilled from the mirror (IDEM.COMPLETE ...
// MIRRORED) and the stored response answered, so a request never runs twice
// because Redis lost data.
import type { Pool } from "pg";
import * as spec from "./spec.js";
import { IdemError, PostgresError } from "./errors.js";
import { storedHex } from "./fingerprint.js";
import { checkout, describe } from "./pg.js";
import { STATUS_MAX, STATUS_MIN } from "./wire.js";
import type { IdemClient } from "./client.js";
import type { BeginOptions, Outcome, StoredResponse } from "./types.js";

/** A completed, unexpired row of the mirror. */
export interface MirroredRecord {
  /** Lowercase hex SHA-256 of the fingerprint bytes sent to BEGIN. */
  fingerprintHex: string;
  response: StoredResponse;
}

/** A row of the lookup: fingerprint, status, body, flat headers. */
export function decodeRow(key: string, fingerprint: unknown, status: unknown, body: unknown, flat: unknown): MirroredRecord {
  if (typeof status !== "number" || !Number.isInteger(status) || status < STATUS_MIN || status > STATUS_MAX) {
    throw new PostgresError(`row for ${JSON.stringify(key)} has status ${String(status)}`);
  }
  const items = ((flat ?? []) as unknown[]).map((item) => (Buffer.isBuffer(item) ? item : Buffer.from(String(item))));
  if (items.length % 2 !== 0) throw new PostgresError(`row for ${JSON.stringify(key)} has an odd number of header items`);
  const headers: [string, Buffer][] = [];
  for (let i = 0; i < items.length; i += 2) headers.push([(items[i] as Buffer).toString("utf8"), items[i + 1] as Buffer]);
  return {
    fingerprintHex: String(fingerprint).toLowerCase(),
    response: { status, body: Buffer.isBuffer(body) ? body : Buffer.alloc(0), headers },
  };
}

const SET_TIMEOUT = "SELECT set_config('statement_timeout', $1, true)";

/** Looks keys up in the writer's idempotency_keys through `pool`; a lookup is bounded by `timeoutMs` (checkout and statement). */
export class ReadThrough {
  readonly pool: Pool;
  readonly timeoutMs: number;

  constructor(pool: Pool, options: { timeoutMs?: number } = {}) {
    this.pool = pool;
    this.timeoutMs = options.timeoutMs ?? spec.readThrough().timeout_ms;
  }

  /**
   * The completed, unexpired mirror row for `key`, if any. The whole lookup (checkout, then its statements) is
   * bounded by timeoutMs: statement_timeout alone does not bound a connection that stops answering (a peer gone
   * silent, a proxy dropping bytes), so past the deadline the client is destroyed and PostgresError thrown.
   */
  async lookup(key: string): Promise<MirroredRecord | null> {
    const deadline = Date.now() + this.timeoutMs;
    const client = await checkout(this.pool, this.timeoutMs);
    const left = Math.max(1, deadline - Date.now());
    const work = (async (): Promise<unknown[] | undefined> => {
      await client.query("BEGIN");
      await client.query(SET_TIMEOUT, [`${left}ms`]);
      const result = await client.query({ text: spec.readThrough().lookup_sql, values: [key], rowMode: "array" });
      await client.query("COMMIT");
      return result.rows[0] as unknown[] | undefined;
    })();
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new PostgresError(`the mirror lookup had no answer within ${this.timeoutMs} ms`)), left);
    });
    let row: unknown[] | undefined;
    try {
      row = await Promise.race([work, late]);
    } catch (err) {
      work.catch(() => undefined); // ends with the destroyed connection
      client.release(true);
      throw err instanceof PostgresError ? err : new PostgresError(describe(err), { cause: err });
    } finally {
      clearTimeout(timer);
    }
    client.release();
    return row === undefined ? null : decodeRow(key, row[0], row[1], row[2], row[3]);
  }

  /**
   * IDEM.BEGIN, then on new the mirror lookup: no row, New; the same fingerprint, Redis refilled and Replay;
   * another, the key released and Mismatch. A lookup that fails releases the key and throws PostgresError
   * (unavailable): the mirror may hold the answer.
   */
  async begin(client: IdemClient, key: string, fingerprint: Uint8Array, options: BeginOptions): Promise<Outcome> {
    const outcome = await client.begin(key, fingerprint, options);
    if (outcome.kind !== "new") return outcome;
    const token = outcome.token;
    let record: MirroredRecord | null;
    try {
      record = await this.lookup(key);
    } catch (err) {
      await release(client, key, token);
      throw err;
    }
    if (record === null) return outcome;
    if (record.fingerprintHex !== storedHex(fingerprint)) {
      await release(client, key, token);
      return { kind: "mismatch" };
    }
    try {
      await client.complete(key, token, record.response, "mirror");
    } catch (err) {
      if (!(err instanceof IdemError)) throw err;
      await release(client, key, token);
    }
    return { kind: "replay", response: record.response };
  }
}

async function release(client: IdemClient, key: string, token: bigint): Promise<void> {
  try {
    await client.abort(key, token);
  } catch (err) {
    if (!(err instanceof IdemError)) throw err;
    // The key frees itself when its lease lapses.
  }
}
