// The Idempotency-Key flow shared by the Express middleware and the Fastify
// plugin, with the HTTP semantics of the Rust layer (docs/client.md,
// "Middleware"; the facts in spec/http.json):
// - methods not covered pass through; no key passes through (or 400 when
//   required); a bad key is a 400 problem; a body over maxRequestBody is 413;
// - new: the handler runs with its lease renewed (TOUCH every third of the
//   lease) and its request's fence; its response is stored with COMPLETE
//   when the store policy says so (all but 5xx and 429) before it is sent,
//   else the key is released (ABORT) so a retry runs again;
// - in_flight: 409 problem with Retry-After (or, with waitForResultMs, the
//   original's answer once it completes); replay: the stored status, body and
//   headers plus Idempotent-Replayed: true; mismatch: 422 problem;
// - Redis (or the mirror) unreachable: 503 problem with Retry-After (fail
//   closed), or the handler runs unprotected with failOpen;
// - a handler that used the fence: Redis is settled by what it did
//   (committed: COMPLETE MIRRORED; decided: the fence's answer; claimed, not
//   committed: the durable claim and the key released);
// - claimUpFront: the fence's durable claim stands in for read-through's
//   lookup, before the handler runs (docs/fence.md; the Rust layer's
//   claim_up_front).
import * as spec from "./spec.js";
import { canonicalize } from "./canonicalJson.js";
import { CompletedError, IdemError, NoBackendError, NotFoundError, PostgresError, StaleError } from "./errors.js";
import { Fence, FenceReport, type Claim, type Layout } from "./fence.js";
import { Fingerprinter } from "./fingerprint.js";
import { checkTenant, InvalidKeyError, InvalidTenantError, parseKey, redisKey, tenantOfLines } from "./keys.js";
import type { Pool } from "pg";
import type { IdemClient } from "./client.js";
import type { ReadThrough } from "./readThrough.js";
import type { InFlight, Mismatch, Outcome, Replay, StoredResponse } from "./types.js";

/** A request as the flow sees it: header names lowercased, one pair per header line, values as sent. */
export interface HttpRequest {
  method: string;
  /** The request target as sent: path and query. */
  target: string;
  headers: [string, Buffer][];
  body: Buffer;
  /**
   * The framework's own request: Express's `req`, Fastify's `request` (after its onRequest hooks). A `tenant`
   * callback reads what the app's authentication left on it.
   */
  source?: unknown;
}

/** A response to send. */
export interface HttpResponse {
  status: number;
  headers: [string, string | Buffer][];
  body: Buffer;
}

export interface Logger {
  warn(message: string): void;
  error(message: string): void;
}

/** Options; each defaults to spec/http.json's defaults. Times in milliseconds, sizes in bytes. */
export interface IdempotencyOptions {
  client: IdemClient;
  /** Read-through from the writer's Postgres mirror when Redis lost a key. */
  readThrough?: ReadThrough;
  methods?: string[];
  header?: string;
  required?: boolean;
  /**
   * The request's tenant, which scopes its keys: the **authenticated caller**, as the app's authentication (run
   * before the middleware) left it on the framework's request, e.g. `(r) => (r.source as AuthedRequest).account`;
   * never a value the client picks. With a tenant source, none (null, undefined) or an empty one is a 400
   * missing_tenant and one over MAX_TENANT_BYTES a 400 invalid_tenant; without one, every caller shares one scope.
   */
  tenant?: (request: HttpRequest) => string | null | undefined;
  /** Scopes keys by a header's value: only for a header a gateway sets after authenticating the caller. */
  tenantHeader?: string;
  keyPrefix?: string;
  ttlMs?: number;
  leaseMs?: number;
  /** Duplicates of a running request wait up to this long for its answer instead of a 409. */
  waitForResultMs?: number;
  maxRequestBody?: number;
  maxResponseBody?: number;
  storedHeaders?: string[];
  /** Whether a response of this status is stored (default: all but 5xx and 429). */
  storePolicy?: (status: number) => boolean;
  /** Run the handler unprotected when Redis is unreachable (default: 503); never when the claim made up front fails. */
  failOpen?: boolean;
  storeRetryMs?: number;
  fingerprinter?: Fingerprinter;
  maxRetryAfterMs?: number;
  /** The idempotency_keys table's layout, for the fence. */
  tableLayout?: Layout;
  /**
   * Claim every request's fence durably before its handler runs, in place of read-through's lookup (default: off;
   * needs readThrough, whose pool and timeout it uses). A completed row is replayed (and refilled into Redis),
   * another request's row is 422, a live claim is 409; otherwise the handler runs holding the claim and its
   * fence.claim(..) resolves Proceed with no statement. For apps whose keyed handlers all use the fence: a
   * handler that does not has the claim released after it returns, then its response is stored as usual.
   */
  claimUpFront?: boolean;
  logger?: Logger;
}

/** What a running request finds: the Redis key, its token and the request's Postgres fence. */
export interface IdempotencyContext {
  key: string;
  token: bigint;
  fingerprint: Buffer;
  ttlMs: number;
  /** The request's fence (docs/fence.md): claim through a pool, then commit the effect; the middleware settles Redis by what it did. */
  fence: Fence;
}

/** What to do with a request: pass it through, answer it, or run the handler under the key. */
export type Start = { kind: "pass" } | { kind: "respond"; response: HttpResponse } | { kind: "run"; run: Run };

/** Everything but 5xx and 429 is stored; those release the key so the client can retry. */
export function defaultStorePolicy(status: number): boolean {
  return !((status >= 500 && status <= 599) || status === 429);
}

const TOKEN_NAME = /^[!#$%&'*+\-.^_`|~0-9a-z]+$/;

/** The problem's application/problem+json body (spec/http.json), as canonical JSON. */
export function problemBody(name: spec.ProblemName, detail?: string): Buffer {
  const p = spec.http().problems[name];
  const body = canonicalize(Buffer.from(JSON.stringify({ type: p.type, title: p.title, status: p.status, detail: detail ?? p.detail })));
  if (body === null) throw new Error("a problem body is JSON");
  return body;
}

export function problem(name: spec.ProblemName, options: { detail?: string; retryAfter?: string } = {}): HttpResponse {
  const p = spec.http().problems[name];
  const h = spec.http().headers;
  const headers: [string, string][] = [[h.content_type, h.problem_content_type]];
  const retryAfter = options.retryAfter ?? p.retry_after;
  if (retryAfter !== undefined) headers.push([h.retry_after, retryAfter]);
  return { status: p.status, headers, body: problemBody(name, options.detail) };
}

/** Retry-After in whole seconds, rounded up, at least 1. */
export function retryAfterHeader(ms: number): string {
  return String(Math.max(1, Math.ceil(Math.round(ms) / 1000)));
}

/** The stored response plus Idempotent-Replayed: true; headers that are not valid HTTP are left out. */
export function replayResponse(stored: StoredResponse, logger?: Logger): HttpResponse {
  const headers: [string, string | Buffer][] = [];
  for (const [name, value] of stored.headers) {
    const lower = name.toLowerCase();
    if (lower === "content-length") continue;
    if (!TOKEN_NAME.test(lower) || value.includes(0x0d) || value.includes(0x0a) || value.includes(0)) {
      logger?.warn(`stored header ${JSON.stringify(name)} is not valid HTTP; left out of the replay`);
      continue;
    }
    headers.push([lower, value]);
  }
  const h = spec.http().headers;
  headers.push([h.replayed, h.replayed_value]);
  return { status: stored.status, headers, body: stored.body };
}

/** The header's lines in a request. */
export function lines(request: HttpRequest, name: string): Buffer[] {
  return request.headers.filter(([n]) => n === name).map(([, v]) => v);
}

/** The flow; one per application, shared by every request. */
export class Idempotency {
  readonly client: IdemClient;
  readonly readThrough: ReadThrough | undefined;
  readonly methods: ReadonlySet<string>;
  readonly header: string;
  readonly required: boolean;
  readonly tenant: ((request: HttpRequest) => string | null | undefined) | undefined;
  readonly keyPrefix: string;
  readonly ttlMs: number;
  readonly leaseMs: number;
  readonly waitMs: number | undefined;
  readonly maxRequestBody: number;
  readonly maxResponseBody: number;
  readonly storedHeaders: readonly string[];
  readonly storePolicy: (status: number) => boolean;
  readonly failOpen: boolean;
  readonly storeRetryMs: number;
  readonly fingerprinter: Fingerprinter;
  readonly maxRetryAfterMs: number;
  readonly tableLayout: Layout;
  readonly claimUpFront: boolean;
  readonly logger: Logger;
  private readonly background = new Set<Promise<unknown>>();
  /** Whether "this Redis has no idem" was logged (once, until a BEGIN succeeds again). */
  private reportedNoBackend = false;

  constructor(options: IdempotencyOptions) {
    const d = spec.http().defaults;
    if (options.tenant !== undefined && options.tenantHeader !== undefined) throw new TypeError("give tenant or tenantHeader, not both");
    if (options.claimUpFront === true && options.readThrough === undefined) throw new TypeError("claimUpFront needs readThrough (its pool and timeout)");
    this.client = options.client;
    this.readThrough = options.readThrough;
    this.methods = new Set((options.methods ?? d.methods).map((m) => m.toUpperCase()));
    this.header = (options.header ?? d.header).toLowerCase();
    this.required = options.required ?? d.required;
    const tenantHeader = options.tenantHeader?.toLowerCase();
    this.tenant = tenantHeader !== undefined ? (r) => tenantOfLines(lines(r, tenantHeader)) : options.tenant;
    this.keyPrefix = options.keyPrefix ?? d.key_prefix;
    this.ttlMs = options.ttlMs ?? d.ttl_ms;
    this.leaseMs = options.leaseMs ?? d.lease_ms;
    this.waitMs = options.waitForResultMs;
    this.maxRequestBody = options.maxRequestBody ?? d.max_request_body;
    this.maxResponseBody = options.maxResponseBody ?? d.max_response_body;
    this.storedHeaders = (options.storedHeaders ?? d.stored_headers).map((n) => n.toLowerCase());
    this.storePolicy = options.storePolicy ?? defaultStorePolicy;
    this.failOpen = options.failOpen ?? d.fail_open;
    this.storeRetryMs = options.storeRetryMs ?? d.store_retry_ms;
    this.fingerprinter = options.fingerprinter ?? new Fingerprinter({ canonicalJson: d.canonical_json });
    this.maxRetryAfterMs = options.maxRetryAfterMs ?? d.max_retry_after_ms;
    this.tableLayout = options.tableLayout ?? "unpartitioned";
    this.claimUpFront = options.claimUpFront ?? false;
    this.logger = options.logger ?? console;
  }

  /** Whether requests of this method go through the flow. */
  covers(method: string): boolean {
    return this.methods.has(method.toUpperCase());
  }

  /** The key header's lines, parsed: null when absent; throws InvalidKeyError. */
  keyOf(request: HttpRequest): string | null {
    return parseKey(lines(request, this.header));
  }

  /** Settles until every background store (responses Redis refused for now) has ended. */
  async drain(): Promise<void> {
    while (this.background.size > 0) await Promise.allSettled([...this.background]);
  }

  keep(task: Promise<unknown>): void {
    this.background.add(task);
    void task.finally(() => this.background.delete(task));
  }

  /** The first step of a request whose whole body has arrived. */
  async start(request: HttpRequest): Promise<Start> {
    if (!this.covers(request.method)) return { kind: "pass" };
    let key: string | null;
    try {
      key = this.keyOf(request);
    } catch (err) {
      if (err instanceof InvalidKeyError) return { kind: "respond", response: problem("invalid_key", { detail: err.detail }) };
      throw err;
    }
    if (key === null) return this.required ? { kind: "respond", response: problem("missing_key") } : { kind: "pass" };
    if (request.body.length > this.maxRequestBody) return { kind: "respond", response: problem("request_too_large") };
    let tenant = ""; // no tenant source: the one anonymous scope
    if (this.tenant !== undefined) {
      try {
        tenant = checkTenant(this.tenant(request));
      } catch (err) {
        if (err instanceof InvalidTenantError) return { kind: "respond", response: problem(err.problem) };
        throw err;
      }
    }
    const rkey = redisKey(this.keyPrefix, tenant, key);
    const fingerprint = this.fingerprinter.fingerprint(request.method, request.target, request.headers, request.body);
    let outcome: Outcome;
    let fence: Fence | null;
    try {
      [outcome, fence] = await this.beginRequest(rkey, fingerprint);
    } catch (err) {
      if (!(err instanceof IdemError)) throw err;
      if (err instanceof NoBackendError) {
        // Every request would say the same: an operator must act (load the module or the library).
        if (!this.reportedNoBackend) this.logger.error(`idempotency store unusable; answering 503 until it is fixed: ${err.message}`);
        this.reportedNoBackend = true;
        return { kind: "respond", response: problem("unavailable") };
      }
      if (this.failsOpenOn(err)) {
        this.logger.warn(`idempotency store unavailable; running unprotected: ${err.message}`);
        return { kind: "pass" };
      }
      if (err.isTransient) {
        this.logger.warn(`idempotency store unavailable; answering 503: ${err.message}`);
        return { kind: "respond", response: problem("unavailable") };
      }
      this.logger.error(`IDEM.BEGIN failed: ${err.message}`);
      return { kind: "respond", response: problem("internal") };
    }
    this.reportedNoBackend = false;
    if (outcome.kind === "new") return { kind: "run", run: new Run(this, rkey, outcome.token, fingerprint, fence ?? undefined) };
    return { kind: "respond", response: this.answer(outcome) };
  }

  /**
   * Whether the handler runs unprotected after the first BEGIN failed with `err`: with failOpen, when the store
   * was unreachable. Never when the claim made up front failed (any PostgresError with claimUpFront: unreachable,
   * late, or refused by a Postgres that answers — read-only, permissions, a missing table): that claim keeps a
   * payment single when Redis forgets, and the handler would run with no fence at all. That is a 503, as in the
   * Rust layer (Config::fails_open_on).
   */
  failsOpenOn(err: IdemError): boolean {
    if (this.claimUpFront && this.readThrough !== undefined && err instanceof PostgresError) return false;
    return this.failOpen && err.isUnreachable;
  }

  /** The fence of a request about to run, with its report attached. */
  fence(key: string, token: bigint, fingerprint: Buffer): Fence {
    const fence = new Fence(key, token, fingerprint, this.ttlMs, { leaseMs: this.leaseMs, layout: this.tableLayout });
    fence.report = new FenceReport();
    return fence;
  }

  /**
   * A request's first BEGIN: begin, or with claimUpFront BEGIN and then the fence's durable claim through
   * read-through's pool (bounded by its timeout) in place of the lookup. What the claim finds is answered as
   * read-through answers a mirror row (a completed row refills Redis and is replayed, another request's row is a
   * mismatch) and a live claim is in flight; in each the key is given back to Redis but for the refill. When
   * Postgres does not answer in time the key is released, the claim (which may still commit) is released in the
   * background once it does, and PostgresError thrown (503). On new with the claim made, the fence holding it.
   */
  async beginRequest(key: string, fingerprint: Buffer): Promise<[Outcome, Fence | null]> {
    const readThrough = this.readThrough;
    if (!this.claimUpFront || readThrough === undefined) return [await this.begin(key, fingerprint), null];
    const outcome = await this.client.begin(key, fingerprint, { ttlMs: this.ttlMs, leaseMs: this.leaseMs, waitMs: this.waitMs });
    if (outcome.kind !== "new") return [outcome, null];
    const token = outcome.token;
    const fence = this.fence(key, token, fingerprint);
    const pool = readThrough.pool;
    const claiming = fence.claim(pool);
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<"late">((resolve) => {
      timer = setTimeout(() => resolve("late"), readThrough.timeoutMs);
    });
    let claim: Claim | "late";
    try {
      claim = await Promise.race([claiming, late]);
    } catch (err) {
      await this.abort(key, token);
      throw err;
    } finally {
      clearTimeout(timer);
    }
    if (claim === "late") {
      this.keep(
        claiming.then(
          (made) => (made.kind === "proceed" ? releaseClaim(fence, pool, this.logger) : undefined),
          () => undefined,
        ),
      );
      await this.abort(key, token);
      throw new PostgresError(`the fence's claim had no answer within ${readThrough.timeoutMs} ms`);
    }
    if (claim.kind === "proceed") {
      fence.report?.set("claimed_up_front", { pool });
      return [outcome, fence];
    }
    if (claim.kind === "replay") {
      try {
        await this.client.complete(key, token, claim.response, "mirror");
      } catch (err) {
        if (!(err instanceof IdemError)) throw err;
        // The row's answer stands; Redis just stays without it.
        this.logger.warn(`${key}: could not refill redis from the fence's row: ${err.message}`);
        await this.abort(key, token);
      }
      return [claim, null];
    }
    await this.abort(key, token);
    return [claim, null];
  }

  /** ABORT; a failure leaves the key to lapse with its lease. */
  async abort(key: string, token: bigint): Promise<void> {
    try {
      await this.client.abort(key, token);
    } catch (err) {
      this.logger.warn(`${key}: ABORT failed; the key frees itself when its lease lapses: ${String(err)}`);
    }
  }

  async begin(key: string, fingerprint: Buffer): Promise<Outcome> {
    const options = { ttlMs: this.ttlMs, leaseMs: this.leaseMs, waitMs: this.waitMs };
    if (this.readThrough !== undefined) return this.readThrough.begin(this.client, key, fingerprint, options);
    return this.client.begin(key, fingerprint, options);
  }

  answer(outcome: InFlight | Replay | Mismatch): HttpResponse {
    if (outcome.kind === "in_flight") return this.inFlight(outcome.retryAfterMs);
    if (outcome.kind === "replay") return replayResponse(outcome.response, this.logger);
    return problem("mismatch");
  }

  inFlight(retryAfterMs: number): HttpResponse {
    return problem("in_flight", { retryAfter: retryAfterHeader(Math.min(retryAfterMs, this.maxRetryAfterMs)) });
  }
}

const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms));
const defaultsMs = (name: "store_at_once_ms" | "store_pause_first_ms" | "store_pause_max_ms"): number => spec.http().defaults[name];

/** The key a request holds while its handler runs: its lease, its fence, and how it is settled. */
export class Run {
  readonly context: IdempotencyContext;
  private readonly flow: Idempotency;
  private readonly report: FenceReport;
  private renewal: NodeJS.Timeout | undefined;
  private settled = false;

  /** `fence`: the request's (flow.fence's by default), or the one holding the claim made up front. */
  constructor(flow: Idempotency, key: string, token: bigint, fingerprint: Buffer, fence: Fence = flow.fence(key, token, fingerprint)) {
    this.flow = flow;
    fence.report ??= new FenceReport();
    this.report = fence.report;
    this.context = { key, token, fingerprint, ttlMs: flow.ttlMs, fence };
    this.keepLease();
  }

  get fence(): Fence {
    return this.context.fence;
  }
  private get key(): string {
    return this.context.key;
  }

  /** TOUCH every third of the lease (at least 10 ms) until the handler ends or the key is no longer ours. */
  private keepLease(): void {
    const every = Math.max(this.flow.leaseMs / 3, 10);
    const tick = async (): Promise<void> => {
      if (this.settled) return;
      try {
        await this.flow.client.touch(this.key, this.context.token, this.flow.leaseMs);
      } catch (err) {
        if (err instanceof StaleError || err instanceof NotFoundError || err instanceof CompletedError) {
          this.flow.logger.warn(`${this.key}: lease lost while the handler runs: ${err.message}`);
          return;
        }
        this.flow.logger.warn(`${this.key}: lease renewal failed; retrying: ${String(err)}`);
      }
      this.renewal = setTimeout(() => void tick(), every);
    };
    this.renewal = setTimeout(() => void tick(), every);
  }

  private stop(): void {
    this.settled = true;
    clearTimeout(this.renewal);
  }

  /**
   * The response outgrew maxResponseBody: it is not stored; the key is released unless the fence was used. Answers
   * the fence's answer when the client gets that instead (Lost, Replay, InFlight, Mismatch: the handler's effect
   * rolled back, so its response must not go out), else null: the response is sent as it comes.
   */
  async overflowed(): Promise<HttpResponse | null> {
    this.stop();
    if (await this.unused()) {
      this.flow.logger.warn(`${this.key}: response larger than maxResponseBody: sent, not stored`);
      await this.release();
      return null;
    }
    const answer = await this.settleFence();
    if (answer === null) this.flow.logger.warn(`${this.key}: response larger than maxResponseBody: sent, not stored in Redis`);
    return answer;
  }

  /** The handler failed without a response (it threw): the key is settled so a retry can run. */
  async failed(): Promise<void> {
    this.stop();
    if (await this.unused()) await this.release();
    else await this.settleFence();
  }

  /** The handler's response: answers what the client gets (the handler's own, or the key's answer when the key was lost meanwhile). */
  async finish(response: HttpResponse): Promise<HttpResponse> {
    this.stop();
    if (!(await this.unused())) return (await this.settleFence()) ?? response;
    if (!this.flow.storePolicy(response.status)) {
      await this.release();
      return response;
    }
    const stored: StoredResponse = {
      status: response.status,
      body: response.body,
      headers: this.flow.storedHeaders.flatMap((name) =>
        response.headers.filter(([n]) => n.toLowerCase() === name).map(([, v]): [string, Buffer] => [name, Buffer.from(v)]),
      ),
    };
    return (await this.store(stored)) ?? response;
  }

  /**
   * Whether the handler left the fence unused. A claim made up front that the handler did not take over is given
   * up first (RELEASE through its pool); the response is then settled as any other.
   */
  private async unused(): Promise<boolean> {
    if (this.report.kind !== "claimed_up_front") return this.report.kind === "unused";
    await releaseClaim(this.fence, this.report.pool, this.flow.logger);
    this.report.set("unused");
    return true;
  }

  /** Settles a key whose handler used the fence; an answer when the client gets the fence's instead of the handler's response. */
  private async settleFence(): Promise<HttpResponse | null> {
    const report = this.report;
    if (report.kind === "committed" && report.committed !== null) {
      await this.storeCommitted(report.committed);
      return null;
    }
    const claim: Claim | null = report.claim;
    if (report.kind === "decided" && claim !== null && claim.kind !== "proceed") {
      if (claim.kind === "replay") {
        await this.refill(claim.response);
        return replayResponse(claim.response, this.flow.logger);
      }
      await this.release();
      return claim.kind === "in_flight" ? this.flow.inFlight(claim.retryAfterMs) : problem("mismatch");
    }
    // Claimed but not committed through the fence: nothing happened, or a retry's claim finds out. A durable
    // claim is given up first, so the retry Redis lets in next proceeds at once.
    if (report.kind === "claimed" || report.kind === "claimed_up_front") await releaseClaim(this.fence, report.pool, this.flow.logger);
    await this.release();
    return null;
  }

  /** The fence committed `stored`: put it into Redis (MIRRORED). */
  private async storeCommitted(stored: StoredResponse): Promise<void> {
    try {
      await this.complete(this.context.token, stored, Date.now() + defaultsMs("store_at_once_ms"), false, "mirror");
    } catch (err) {
      this.flow.logger.warn(`${this.key}: the fenced response is committed in Postgres; Redis did not take it: ${String(err)}`);
    }
  }

  private async refill(stored: StoredResponse): Promise<void> {
    try {
      await this.flow.client.complete(this.key, this.context.token, stored, "mirror");
    } catch (err) {
      if (!(err instanceof IdemError)) throw err;
      this.flow.logger.warn(`${this.key}: could not refill redis from the fence's row: ${err.message}`);
      await this.release();
    }
  }

  /** ABORT; a failure leaves the key to lapse with its lease. */
  async release(token: bigint = this.context.token): Promise<void> {
    await this.flow.abort(this.key, token);
  }

  /** Stores the handler's response; an answer when the key's answer is not the handler's own (taken over or lost meanwhile). */
  private async store(stored: StoredResponse): Promise<HttpResponse | null> {
    try {
      await this.complete(this.context.token, stored, Date.now() + defaultsMs("store_at_once_ms"));
      return null;
    } catch (err) {
      if (!(err instanceof IdemError)) throw err;
      if (err.isTransient) {
        this.flow.logger.warn(`${this.key}: COMPLETE failed: the response is sent, storing it goes on in the background: ${err.message}`);
        this.storeInBackground(this.context.token, stored);
        return null;
      }
      return this.settleStoreError(err, stored, this.context.token);
    }
  }

  private async settleStoreError(err: IdemError, stored: StoredResponse, token: bigint): Promise<HttpResponse | null> {
    if (err instanceof StaleError || err instanceof NotFoundError) {
      this.flow.logger.warn(`${this.key}: the key was taken over or lost before COMPLETE: ${err.message}`);
      return this.answerAgain(stored);
    }
    if (err.isTransient) {
      this.flow.logger.error(`${this.key}: gave up storing the response: ${err.message}`);
      return null;
    }
    this.flow.logger.error(`${this.key}: COMPLETE refused; response sent, not stored, key released: ${err.message}`);
    await this.release(token);
    return null;
  }

  /** COMPLETE, retried while Redis is unavailable until `giveUp`; after an attempt whose fate is unknown, COMPLETED is its own write. */
  private async complete(token: bigint, stored: StoredResponse, giveUp: number, uncertain = false, origin: "handler" | "mirror" = "handler"): Promise<void> {
    let pause = defaultsMs("store_pause_first_ms");
    for (;;) {
      try {
        await this.flow.client.complete(this.key, token, stored, origin);
        return;
      } catch (err) {
        if (err instanceof CompletedError && uncertain) return;
        if (!(err instanceof IdemError)) throw err;
        const now = Date.now();
        if (!err.isTransient || now >= giveUp) throw err;
        uncertain = true;
        await sleep(Math.min(pause, giveUp - now));
        pause = Math.min(pause * 2, defaultsMs("store_pause_max_ms"));
      }
    }
  }

  private storeInBackground(token: bigint, stored: StoredResponse): void {
    const task = (async () => {
      try {
        await this.complete(token, stored, Date.now() + this.flow.storeRetryMs, true);
      } catch (err) {
        if (err instanceof IdemError) await this.settleStoreError(err, stored, token);
      }
    })();
    this.flow.keep(task);
  }

  private async answerAgain(stored: StoredResponse): Promise<HttpResponse | null> {
    let outcome: Outcome;
    try {
      outcome = await this.flow.begin(this.key, this.context.fingerprint);
    } catch (err) {
      this.flow.logger.warn(`${this.key}: BEGIN after a failed COMPLETE failed: ${String(err)}`);
      return null;
    }
    if (outcome.kind !== "new") return this.flow.answer(outcome);
    try {
      await this.complete(outcome.token, stored, Date.now() + defaultsMs("store_at_once_ms"));
    } catch (err) {
      if (err instanceof IdemError && err.isTransient) this.storeInBackground(outcome.token, stored);
      else {
        this.flow.logger.warn(`${this.key}: could not store the response under a new token: ${String(err)}`);
        await this.release(outcome.token);
      }
    }
    return null;
  }
}

/** Gives up the fence's durable claim made through `pool` (none without one); a failure leaves it to end with its lease. */
async function releaseClaim(fence: Fence, pool: Pool | null, logger: Logger): Promise<void> {
  if (pool === null) return;
  try {
    await fence.release(pool);
  } catch (err) {
    logger.warn(`${fence.key}: could not release the fence's claim; it ends with its lease: ${String(err)}`);
  }
}
