// The Postgres fence (docs/fence.md; the Rust idem_client::Fence) over
// node-postgres: a key's idempotency row is claimed durably (a short
// statement of its own, with a lease) before the handler calls anything
// outside Postgres, and completed in the short transaction that writes the
// business effect, only while it is still held with the claim's token (or,
// for an effect that is one INSERT, UPDATE or DELETE, in one autocommitted
// statement with it: commitEffect). The effect and the authoritative record
// commit or roll back together whatever Redis forgets, and no transaction
// spans a foreign call. The statements are the Rust crate's, read from
// spec/fence.json and run as written.
import type { ClientBase, Pool, QueryResult } from "pg";
import * as spec from "./spec.js";
import { BadArgError, PostgresError } from "./errors.js";
import { downstreamKeyOf, storedHex } from "./fingerprint.js";
import { decodeRow } from "./readThrough.js";
import { isPool, describe, sqlstate, type Source } from "./pg.js";
import { checkToken, STATUS_MAX, STATUS_MIN } from "./wire.js";
import type { InFlight, Mismatch, Replay, StoredResponse } from "./types.js";

/** The statements run as written (complete_with_effect takes the caller's effect: effectQuery). */
type Statement = Exclude<keyof spec.FenceSpec["statements"], "complete_with_effect">;

/** This holder holds the key: run the business logic, then commit. */
export interface Proceed {
  kind: "proceed";
}
/** What a claim found. InFlight carries the fence's Retry-After (spec/http.json fence_retry_after_ms). */
export type Claim = Proceed | Replay | InFlight | Mismatch;
/** The key's row holds the response (committed by commit; by complete, to commit with the transaction). */
export interface Committed {
  kind: "committed";
}
/** hold: still held with this token, the lease renewed. */
export interface Held {
  kind: "held";
}
/** This holder lost the key (its lease lapsed and a retry took it over, or the row was released): commit nothing; answer `claim`. */
export interface Lost {
  kind: "lost";
  claim: Replay | InFlight | Mismatch;
}

/** The table's layout (crates/idem-writer/migrations): one table, or partitioned by expiry. */
export type Layout = "unpartitioned" | "partitioned";

export interface FenceOptions {
  /** The durable claim's lease in ms (default: spec/http.json lease_ms). */
  leaseMs?: number;
  /** idle_in_transaction_session_timeout and lock_timeout of the fence's transactions: "lease" (default), ms, or null (leave the session's). */
  idleTimeoutMs?: number | "lease" | null;
  layout?: Layout;
}

const inFlight = (): InFlight => ({ kind: "in_flight", retryAfterMs: spec.http().defaults.fence_retry_after_ms });

/** The query of statement `name` of spec/fence.json with `values`, one per parameter it names (rows as arrays). */
function statement(name: Statement, values: unknown[]): { text: string; values: unknown[]; rowMode: "array" } {
  const { sql, params } = spec.fence().statements[name];
  if (values.length !== params.length) {
    throw new PostgresError(`spec/fence.json's ${name} takes ${params.length} parameters (${params.join(", ")}), not ${values.length}`);
  }
  return { text: sql, values, rowMode: "array" };
}
/**
 * commitEffect's effect, checked before anything is sent: one INSERT, UPDATE or DELETE (its first word, in any case;
 * a SELECT there would never run), trimmed, a trailing semicolon dropped. Otherwise the package's BadArgError.
 */
function effectStatement(effect: unknown): string {
  if (typeof effect !== "string") throw new TypeError(`the fenced effect must be an SQL string, not ${typeof effect}`);
  const trimmed = effect.trim().replace(/;+$/, "").trimEnd();
  const verb = (/^[A-Za-z]*/.exec(trimmed)?.[0] ?? "").toLowerCase();
  if (!["insert", "update", "delete"].includes(verb)) {
    throw new BadArgError(`the fenced effect must be one INSERT, UPDATE or DELETE statement, not ${JSON.stringify(trimmed.slice(0, 40))}`);
  }
  return trimmed;
}

/**
 * spec/fence.json's complete_with_effect with `effect` (checked by effectStatement) in place of its placeholder:
 * `fenceValues` are its own parameters, `effectValues` the effect's, numbered from effect_first_param.
 */
function effectQuery(effect: string, fenceValues: unknown[], effectValues: readonly unknown[]): { text: string; values: unknown[]; rowMode: "array" } {
  const { sql, params, effect_placeholder: placeholder, effect_first_param: first } = spec.fence().statements.complete_with_effect;
  if (fenceValues.length !== params.length || first !== params.length + 1 || !sql.includes(placeholder)) {
    throw new PostgresError(`spec/fence.json's complete_with_effect takes ${params.length} parameters before the effect's ($${first}), and ${placeholder} in its SQL`);
  }
  // A function, so that `$$` or `$&` in the effect are not read as replacement patterns.
  return { text: sql.replace(placeholder, () => effect), values: [...fenceValues, ...effectValues], rowMode: "array" };
}

const ms = (v: number | null): string | null => (v === null ? null : String(Math.max(1, Math.round(v))));

/**
 * What the handler did with its fence, as the middleware reads it. "claimed_up_front": the middleware claimed
 * durably (through `pool`) before the handler ran (its claimUpFront), and the handler has not used the fence yet.
 */
export class FenceReport {
  kind: "unused" | "claimed_up_front" | "claimed" | "decided" | "committed" = "unused";
  claim: Claim | null = null;
  committed: StoredResponse | null = null;
  pool: Pool | null = null;

  set(kind: FenceReport["kind"], more: { claim?: Claim; committed?: StoredResponse; pool?: Pool | null } = {}): void {
    this.kind = kind;
    this.claim = more.claim ?? null;
    this.committed = more.committed ?? null;
    this.pool = more.pool ?? null;
  }

  /** The handler takes over the claim made up front, if there is one: it is then a claim made through its pool. */
  takeUpFront(): boolean {
    if (this.kind !== "claimed_up_front") return false;
    this.kind = "claimed";
    return true;
  }
}

interface Row {
  fingerprintHex: string;
  completed: boolean;
  token: bigint;
  alive: boolean;
  response: StoredResponse | null;
}

function toRow(key: string, row: unknown[] | undefined): Row | null {
  if (row === undefined) return null;
  const [fingerprint, status, token, alive, responseStatus, body, headers] = row;
  const completed = status === "completed";
  const response =
    completed && responseStatus !== null ? decodeRow(key, fingerprint, responseStatus, body, headers).response : null;
  return { fingerprintHex: String(fingerprint).toLowerCase(), completed, token: BigInt(String(token)), alive: alive === true, response };
}

/** The decision on a row a claim did not take (docs/fence.md; spec/fence.json protocol.decide). */
export function decide(row: Row | null, fingerprintHex: string, token: bigint): Claim {
  if (row === null) return inFlight(); // deleted since (released, or cleaned up): ask again
  if (!row.completed && row.token === token) return { kind: "proceed" }; // claimed with this very token before
  if (!row.alive) return inFlight(); // expired, but a larger token has it
  if (row.fingerprintHex !== fingerprintHex) return { kind: "mismatch" };
  if (row.completed && row.response !== null) return { kind: "replay", response: row.response };
  return inFlight();
}

/** Bytes of a response's body or header value as a Buffer, or a TypeError naming `what`. */
function bytesOf(value: unknown, what: string): Buffer {
  if (Buffer.isBuffer(value)) return value;
  if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength);
  throw new TypeError(`the response's ${what} must be a Buffer or Uint8Array (storedResponse() converts text), not ${typeof value}`);
}

/**
 * The completion's status, body and flat headers, checked and encoded here, so that node-postgres has nothing
 * left it could fail to encode once the completion is queued (a value it cannot encode fails the query before
 * it is sent, and a pipelined COMMIT behind it would commit the effect without the completion).
 */
function encoded(response: unknown): [number, Buffer, Buffer[]] {
  if (typeof response !== "object" || response === null) throw new TypeError("the response must be a StoredResponse (storedResponse() makes one)");
  const { status, body, headers } = response as { status: unknown; body: unknown; headers: unknown };
  if (typeof status !== "number" || !Number.isInteger(status) || status < STATUS_MIN || status > STATUS_MAX) {
    throw new TypeError(`the response's status must be an integer from ${STATUS_MIN} to ${STATUS_MAX}, not ${String(status)}`);
  }
  if (!Array.isArray(headers)) throw new TypeError("the response's headers must be an array of [name, value] pairs");
  const flat = headers.flatMap((pair: unknown, i: number) => {
    if (!Array.isArray(pair) || pair.length !== 2 || typeof pair[0] !== "string") {
      throw new TypeError(`the response's header ${i} must be a [name: string, value: Buffer] pair`);
    }
    return [Buffer.from(pair[0], "utf8"), bytesOf(pair[1], `header ${JSON.stringify(pair[0])}'s value`)];
  });
  return [status, bytesOf(body, "body"), flat];
}

/** The unpartitioned claim's ON CONFLICT (key) on a partitioned table has no unique index to use (42P10): say which fence to use. */
function claimError(err: unknown): PostgresError {
  if (err instanceof PostgresError) return err;
  if (sqlstate(err) === "42P10") {
    return new PostgresError(`${describe(err)}: idempotency_keys looks partitioned; use layout "partitioned"`, { cause: err });
  }
  return new PostgresError(describe(err), { cause: err });
}

const STATUS: Record<string, string> = { I: "idle, outside any transaction", T: "inside a transaction", E: "in a failed transaction" };

/**
 * Refuses, before any statement, a client whose transaction status (node-postgres' getTransactionStatus, from the
 * server's last ReadyForQuery) is not `wanted`: "T" for the calls that write in the caller's transaction (outside
 * one, the effect and the completion would each commit at once, the gate would be released after its statement,
 * and a Lost holder's ROLLBACK would undo nothing), "I" for a durable claim on a client (its own BEGIN...COMMIT
 * would commit the caller's open transaction).
 */
function requireStatus(conn: ClientBase, wanted: "I" | "T", call: string): void {
  const get = (conn as { getTransactionStatus?: () => string | null }).getTransactionStatus;
  if (typeof get !== "function") {
    throw new PostgresError(`Fence.${call} needs a node-postgres client with getTransactionStatus() (pg 8.23 has it)`);
  }
  const status = get.call(conn);
  if (status === wanted) return;
  const found = `its transaction status ${String(status)} (${STATUS[String(status)] ?? "not connected"})`;
  throw new PostgresError(
    wanted === "T"
      ? `Fence.${call} runs inside the caller's transaction: call it after BEGIN on the client that writes the effect, not on a client with ${found}`
      : `Fence.${call} needs a pool or a client outside any transaction, not a client with ${found}: it commits a transaction of its own`,
  );
}

/** Whether node-postgres sends `conn`'s queries without waiting for the answer before (its pipeline mode). */
function pipelined(conn: ClientBase): boolean {
  return (conn as { pipeline?: unknown }).pipeline === true;
}

/**
 * The failure COMPLETE_SQL makes when asked to (fail_when_not_held) and the row is not held with the token: a cast
 * error naming the fence (spec/fence.json not_held).
 */
const NOT_HELD = spec.fence().not_held;

/** How a completion fails when a takeover moved the row to another partition (spec/fence.json moved). */
const MOVED = spec.fence().moved;

function isNotHeld(err: unknown): boolean {
  return sqlstate(err) === NOT_HELD.sqlstate && describe(err).includes(NOT_HELD.message_contains);
}

/**
 * A serialization failure: on the partitioned layout, what a completion waiting for the gate meets when a takeover
 * moved the row to another partition meanwhile (under READ COMMITTED too).
 */
function isMoved(err: unknown): boolean {
  return sqlstate(err) === MOVED.sqlstate;
}

/**
 * Checks how the server answered a COMMIT: `expected` is COMMIT after a completion that answered, ROLLBACK after one
 * that failed (the server answers ROLLBACK to a COMMIT of an aborted transaction). `failure` is the completion's.
 */
function ended(result: QueryResult, expected: "COMMIT" | "ROLLBACK", failure?: unknown): void {
  if (result.command === expected) return;
  if (expected === "COMMIT") throw new PostgresError(`COMMIT was answered ${result.command}: nothing was committed`);
  // Only a failure node-postgres made itself (the server never aborted the transaction) can get here.
  throw new PostgresError(`${describe(failure)}, and the COMMIT sent behind it was answered ${result.command}`, { cause: failure });
}

/** The fence of one request. The middleware hands one to every request it runs. */
export class Fence {
  readonly key: string;
  readonly token: bigint;
  readonly fingerprintHex: string;
  readonly ttlMs: number;
  readonly leaseMs: number;
  readonly idleTimeoutMs: number | null;
  readonly layout: Layout;
  /** Set by the middleware: what the handler did. */
  report: FenceReport | null = null;

  constructor(key: string, token: bigint, fingerprint: Uint8Array, ttlMs: number, options: FenceOptions = {}) {
    checkToken(token);
    this.key = key;
    this.token = token;
    this.fingerprintHex = storedHex(fingerprint);
    this.ttlMs = ttlMs;
    this.leaseMs = options.leaseMs ?? spec.http().defaults.lease_ms;
    const idle = options.idleTimeoutMs === undefined ? "lease" : options.idleTimeoutMs;
    this.idleTimeoutMs = idle === "lease" ? this.leaseMs : idle;
    this.layout = options.layout ?? "unpartitioned";
  }

  /** A key for a downstream API's own idempotency (a processor's Idempotency-Key): the same for every attempt at this request. */
  downstreamKey(): string {
    return downstreamKeyOf(this.key, this.fingerprintHex);
  }

  private async raw(conn: ClientBase | Pool, name: Statement | "read_committed", params: unknown[]): Promise<unknown[] | undefined> {
    const query =
      name === "read_committed" ? { text: "SET TRANSACTION ISOLATION LEVEL READ COMMITTED", rowMode: "array" as const } : statement(name, params);
    const result = await conn.query(query);
    return result.rows[0] as unknown[] | undefined;
  }

  private claimParams(synchronousCommit: string | null, idle: string | null): unknown[] {
    return [this.key, this.fingerprintHex, this.token.toString(), this.ttlMs / 1000, this.leaseMs / 1000, synchronousCommit, idle];
  }

  private async settle(conn: ClientBase | Pool, free: boolean, claimed: boolean): Promise<Claim> {
    if (claimed) return { kind: "proceed" };
    if (!free) return inFlight();
    const row = await this.raw(conn, "row", [this.key]);
    return decide(toRow(this.key, row), this.fingerprintHex, this.token);
  }

  private async claimOn(conn: ClientBase | Pool, sync: string | null, idle: string | null): Promise<Claim> {
    if (this.layout === "unpartitioned") {
      const [free, claimed] = (await this.raw(conn, "claim", this.claimParams(sync, idle))) as [boolean, boolean];
      return this.settle(conn, free, claimed);
    }
    const [free, isolation] = (await this.raw(conn, "partitioned_gate", [this.key, sync, idle])) as [boolean, string];
    if (isolation !== "read committed") {
      throw new PostgresError(`the partitioned fence needs a READ COMMITTED transaction, not ${isolation}`);
    }
    if (!free) return inFlight();
    const [claimed] = (await this.raw(conn, "partitioned_claim", this.claimParams(sync, idle).slice(0, 5))) as [boolean];
    return this.settle(conn, true, claimed);
  }

  private after(claim: Claim, pool: Pool | null = null): Claim {
    if (claim.kind === "proceed") this.report?.set("claimed", { pool });
    else this.report?.set("decided", { claim });
    return claim;
  }

  /**
   * Claims the key durably: the in_progress row, with this token and a lease, commits on its own before this
   * resolves. Call anything outside Postgres now (with downstreamKey()), then commit the effect in a short
   * transaction. `source` is a pool or a client outside any transaction (a client inside one is refused: the
   * claim's own transaction would commit the caller's, or the claim would commit only with it). Behind the middleware's claimUpFront
   * the first call resolves Proceed at once, with no statement (the middleware claimed).
   */
  async claim(source: Source): Promise<Claim> {
    if (this.report?.takeUpFront() === true) return { kind: "proceed" };
    const pool = isPool(source) ? source : null;
    if (pool === null) requireStatus(source as ClientBase, "I", "claim");
    let claim: Claim;
    try {
      if (this.layout === "unpartitioned") {
        // One statement, committed on its own (synchronous_commit off: the completion's gate orders what follows).
        claim = await this.claimOn(source, "off", null);
      } else {
        // The partitioned layout's two statements: a short transaction of their own at READ COMMITTED
        // whatever the default, holding the gate no longer than the idle timeout should the claimer vanish.
        const conn = pool === null ? (source as ClientBase) : await pool.connect();
        let broken = false;
        try {
          await conn.query("BEGIN");
          try {
            await this.raw(conn, "read_committed", []);
            claim = await this.claimOn(conn, "off", ms(this.idleTimeoutMs));
            await conn.query("COMMIT");
          } catch (err) {
            await conn.query("ROLLBACK").catch(() => {
              broken = true;
            });
            throw err;
          }
        } finally {
          if (pool !== null) (conn as { release?: (e?: boolean) => void }).release?.(broken);
        }
      }
    } catch (err) {
      throw claimError(err);
    }
    return this.after(claim, pool);
  }

  /**
   * Claims the key inside the caller's open transaction on `conn` (effects only in Postgres: claim, effect
   * and completion commit together; its rollback undoes the claim). Behind claimUpFront, see claim: the claim
   * made up front has committed already, and the middleware releases it unless the completion commits.
   */
  async claimIn(conn: ClientBase): Promise<Claim> {
    requireStatus(conn, "T", "claimIn");
    if (this.report?.takeUpFront() === true) return { kind: "proceed" };
    let claim: Claim;
    try {
      claim = await this.claimOn(conn, null, ms(this.idleTimeoutMs));
    } catch (err) {
      throw claimError(err);
    }
    return this.after(claim);
  }

  /** COMPLETE_SQL's parameters: `fail` makes a row not held fail the statement (and so abort the transaction). */
  private completion(response: StoredResponse, fail: boolean): unknown[] {
    return [...this.completionWithEffect(response), fail];
  }

  /** COMPLETE_WITH_EFFECT_SQL's own parameters (COMPLETE_SQL's but fail_when_not_held: it always fails when not held). */
  private completionWithEffect(response: StoredResponse): unknown[] {
    const [status, body, headers] = encoded(response); // a TypeError before anything is sent
    return [this.key, this.token.toString(), status, body, headers, ms(this.idleTimeoutMs)];
  }

  /** After a fenced write found no row held with this token: what the key holds (a Proceed there is InFlight). */
  private async lost(conn: ClientBase): Promise<Lost> {
    const row = await this.raw(conn, "row", [this.key]);
    const claim = decide(toRow(this.key, row), this.fingerprintHex, this.token);
    const lost: Lost = { kind: "lost", claim: claim.kind === "proceed" ? inFlight() : claim };
    this.report?.set("decided", { claim: lost.claim });
    return lost;
  }

  /**
   * After commit's transaction ended with its completion failed by `failure` (not held, or the row moved): Lost,
   * with what the key holds; a moved row still this holder's is its own serialization failure: the error.
   */
  private async lostAfter(conn: ClientBase, failure: unknown): Promise<Lost> {
    let row;
    try {
      row = toRow(this.key, await this.raw(conn, "row", [this.key])); // outside the transaction
    } catch (err) {
      throw new PostgresError(describe(err), { cause: err });
    }
    const claim = decide(row, this.fingerprintHex, this.token);
    if (claim.kind === "proceed" && !isNotHeld(failure)) throw new PostgresError(describe(failure), { cause: failure });
    const lost: Lost = { kind: "lost", claim: claim.kind === "proceed" ? inFlight() : claim };
    this.report?.set("decided", { claim: lost.claim });
    return lost;
  }

  /** `name` ("complete" with fail_when_not_held false, or "renew") in the caller's transaction: held, or Lost. */
  private async write(conn: ClientBase, name: "complete" | "renew", params: unknown[]): Promise<Held | Lost> {
    try {
      const [held] = (await this.raw(conn, name, params)) ?? [];
      return held === true ? { kind: "held" } : await this.lost(conn);
    } catch (err) {
      throw new PostgresError(describe(err), { cause: err });
    }
  }

  /**
   * Writes the response into the key's row in the caller's open transaction, if this holder still holds it (the
   * key's gate taken first, waiting: from here to the transaction's end every claim of the key answers in flight);
   * on Lost roll back.
   */
  async complete(conn: ClientBase, response: StoredResponse): Promise<Committed | Lost> {
    requireStatus(conn, "T", "complete");
    const written = await this.write(conn, "complete", this.completion(response, false));
    return written.kind === "held" ? { kind: "committed" } : written;
  }

  /**
   * complete and COMMIT of the client's open transaction (write the effect in it first, after BEGIN; the transaction
   * itself, not a savepoint), then tells the middleware; on Lost nothing is committed. Either way, and on a
   * PostgresError, the client is left outside any transaction (unless its connection broke).
   *
   * On a client in node-postgres' pipeline mode (`pipeline: true` in its or its pool's config) the completion and
   * COMMIT go out at once, in that order (each query its own message sequence, with its own Sync): one round trip.
   * The completion is asked to fail when the row is not held, which aborts the transaction, so the server answers
   * the COMMIT behind it with ROLLBACK; the key's row is then read outside the transaction. Otherwise node-postgres
   * sends a query only once the one before has answered: the completion, then COMMIT, or on Lost the row and
   * ROLLBACK. On the partitioned layout a takeover that moved the row while the completion waited for the gate
   * (40001) is Lost too, unless the row is still this holder's (then the error). A response that is not a valid
   * StoredResponse throws a TypeError after ROLLBACK, before anything else is sent.
   */
  async commit(conn: ClientBase, response: StoredResponse): Promise<Committed | Lost> {
    requireStatus(conn, "T", "commit"); // refused: the caller's transaction, if any, is left as it is
    const result = pipelined(conn) ? await this.commitPipelined(conn, response) : await this.commitInTurn(conn, response);
    if (result.kind === "committed") this.report?.set("committed", { committed: response });
    return result;
  }

  private async commitPipelined(conn: ClientBase, response: StoredResponse): Promise<Committed | Lost> {
    let query;
    try {
      query = statement("complete", this.completion(response, true));
    } catch (err) {
      await conn.query("ROLLBACK").catch(() => undefined);
      throw err;
    }
    // node-postgres answers a query synchronously only when it failed to send it (a parameter it cannot encode:
    // it then sends Close and Sync, and nothing failed on the server): then no COMMIT, which would commit the
    // effect without the completion, but ROLLBACK.
    const send = { querying: true, unsent: false };
    const sent = new Promise<QueryResult>((resolve, reject) => {
      conn.query(query, (err: Error | undefined, result: QueryResult) => {
        if (send.querying) send.unsent = true;
        if (err) reject(err);
        else resolve(result);
      });
    });
    send.querying = false;
    if (send.unsent) {
      const failure = await sent.then(
        () => new PostgresError("node-postgres answered the completion before sending it"),
        (err: unknown) => err,
      );
      await conn.query("ROLLBACK").catch(() => undefined);
      throw failure instanceof PostgresError ? failure : new PostgresError(describe(failure), { cause: failure });
    }
    // Both queries are made in this tick, so node-postgres writes them in this order before any answer.
    const [completion, commit] = await Promise.allSettled([sent, conn.query("COMMIT")]);
    if (completion.status === "fulfilled") {
      // A row not held fails the statement, so it answered held: committed, unless COMMIT failed.
      if (commit.status === "rejected") throw new PostgresError(describe(commit.reason), { cause: commit.reason });
      ended(commit.value, "COMMIT");
      const [held] = (completion.value.rows[0] as unknown[] | undefined) ?? [];
      if (held !== true) {
        throw new PostgresError("the completion answered not held instead of failing: the COMMIT sent behind it committed the transaction");
      }
      return { kind: "committed" };
    }
    // The completion failed: the server answers the COMMIT behind it with ROLLBACK (an aborted transaction).
    // A COMMIT that failed too means the connection did: the server rolls back when it goes.
    if (commit.status === "rejected") throw new PostgresError(describe(completion.reason), { cause: completion.reason });
    ended(commit.value, "ROLLBACK", completion.reason);
    if (!isNotHeld(completion.reason) && !isMoved(completion.reason)) {
      throw new PostgresError(describe(completion.reason), { cause: completion.reason });
    }
    return this.lostAfter(conn, completion.reason);
  }

  private async commitInTurn(conn: ClientBase, response: StoredResponse): Promise<Committed | Lost> {
    let written: Held | Lost;
    try {
      written = await this.write(conn, "complete", this.completion(response, false));
    } catch (err) {
      const cause = err instanceof PostgresError ? err.cause : err;
      const rolledBack = await conn.query("ROLLBACK").then(
        () => true,
        () => false,
      );
      if (rolledBack && isMoved(cause)) return this.lostAfter(conn, cause);
      throw err;
    }
    try {
      if (written.kind === "lost") {
        await conn.query("ROLLBACK");
        return written;
      }
      ended(await conn.query("COMMIT"), "COMMIT");
    } catch (err) {
      throw err instanceof PostgresError ? err : new PostgresError(describe(err), { cause: err });
    }
    return { kind: "committed" };
  }

  /**
   * commit without a transaction, for an effect that is one INSERT, UPDATE or DELETE whose values (and so the
   * response) are known before it runs (ids the application makes or reserved, its own clock): the completion and
   * `effect` commit together in one autocommitted statement (spec/fence.json complete_with_effect), one round trip
   * instead of BEGIN, the effect, the completion and COMMIT. Number the effect's parameters from $7
   * (effect_first_param; the fence's own come first) and pass their values as `params`. Then tells the middleware,
   * as commit does. The completion commits whatever rows the effect wrote, none included: an effect that may write
   * none (a conditional UPDATE, ON CONFLICT DO NOTHING) belongs in commit's transaction, where the handler sees the
   * row count first.
   *
   * `source` is a pool (a client is taken for the call) or a client outside any transaction (a client inside one is
   * refused: the statement would commit only with the caller's transaction, and a Lost holder's effect with it). An
   * effect that is not one INSERT, UPDATE or DELETE is a BadArgError and a response that is not a valid
   * StoredResponse a TypeError, both before anything is sent. When the key was lost (the statement fails as not
   * held, or on the partitioned layout a takeover moved the row while it waited for the gate) nothing is committed,
   * the effect neither, and the answer is Lost with what the key holds, read outside any transaction (a moved row
   * still this holder's is the error). An effect that fails (a constraint) fails the completion with it: nothing is
   * committed, the claim stays this holder's, and the error is a PostgresError.
   */
  async commitEffect(source: Source, response: StoredResponse, effect: string, params: readonly unknown[] = []): Promise<Committed | Lost> {
    const pool = isPool(source) ? source : null;
    if (pool === null) requireStatus(source as ClientBase, "I", "commitEffect"); // refused: nothing sent
    if (!Array.isArray(params)) throw new TypeError("the fenced effect's parameters must be an array");
    const query = effectQuery(effectStatement(effect), this.completionWithEffect(response), params);
    let conn: ClientBase;
    try {
      conn = pool === null ? (source as ClientBase) : await pool.connect();
    } catch (err) {
      throw new PostgresError(describe(err), { cause: err });
    }
    let broken = false;
    try {
      // A row not held fails the statement, so an answer is the completion's and the effect's commit.
      await conn.query(query);
    } catch (err) {
      // No SQLSTATE: not the server's answer (the connection, or a parameter node-postgres could not encode).
      broken = sqlstate(err) === undefined;
      if (!isNotHeld(err) && !isMoved(err)) throw new PostgresError(describe(err), { cause: err });
      return await this.lostAfter(conn, err);
    } finally {
      if (pool !== null) (conn as { release?: (e?: boolean) => void }).release?.(broken);
    }
    this.report?.set("committed", { committed: response });
    return { kind: "committed" };
  }

  /**
   * Confirms in the caller's transaction that the key is still this holder's and renews its lease, the key's gate
   * taken first as complete takes it: it stays held until the transaction ends. On Lost roll back.
   */
  async hold(conn: ClientBase): Promise<Held | Lost> {
    requireStatus(conn, "T", "hold");
    const held = await this.write(conn, "renew", [this.key, this.token.toString(), this.leaseMs / 1000, ms(this.idleTimeoutMs)]);
    // A phase may commit effects: from here the middleware no longer releases the claim (a retry waits for its lease).
    if (held.kind === "held") this.report?.set("claimed");
    return held;
  }

  /** Gives up a durable claim that will not be committed. */
  async release(source: Source): Promise<void> {
    try {
      await this.raw(source, "release", [this.key, this.token.toString()]);
    } catch (err) {
      throw new PostgresError(describe(err), { cause: err });
    }
    this.report?.set("claimed");
  }
}
