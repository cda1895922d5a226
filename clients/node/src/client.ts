// IdemClient: the IDEM.* commands over a node-redis client (@redis/client).
// node-redis was measured against ioredis on this project's machine and
// chosen for its throughput (clients/node/README.md, "Why node-redis").
//
// Three backends answer the same commands: the module (IDEM.* commands), the
// Functions library (FCALL idem_*; for a Redis that refuses MODULE LOAD) and
// the same library as scripts (EVALSHA; Redis 6). spec/functions.json is the
// calling contract.
import { createHash } from "node:crypto";
import { createClient, ErrorReply, RESP_TYPES, type RedisClientOptions } from "@redis/client";
import * as spec from "./spec.js";
import * as wire from "./wire.js";
import { outboxKey } from "./slot.js";
import { IdemError, BadArgError, NoBackendError, OtherRedisError, UnavailableError, fromRedis } from "./errors.js";
import type { BeginOptions, InFlight, KeyRecord, Origin, Outcome, StoredResponse } from "./types.js";

/**
 * Replies as this package reads them: bulk and simple strings as Buffers, integers as decimal strings (no
 * precision lost, and never mistaken for a string's bytes).
 */
const TYPE_MAPPING = { [RESP_TYPES.BLOB_STRING]: Buffer, [RESP_TYPES.SIMPLE_STRING]: Buffer, [RESP_TYPES.NUMBER]: String } as const;

/** The part of a node-redis client this package uses. */
export interface RedisLike {
  sendCommand(args: wire.Arg[], options?: Record<string, unknown>): Promise<unknown>;
  duplicate(): RedisLike;
  connect(): Promise<unknown>;
  close?(): Promise<unknown>;
  destroy?(): void;
  readonly isOpen: boolean;
}

/** The Rust client's default bound on each call (spec/http.json). */
export const defaultCallTimeoutMs = (): number => spec.http().defaults.call_timeout_ms;

/** Where the commands run: the module, the Functions library (FCALL), or the library as scripts (EVALSHA). */
export type Backend = "module" | "functions" | "scripts";
/** A backend, or "auto": the module where IDEM.BEGIN exists, else the library, else scripts. */
export type BackendChoice = "auto" | Backend;

export const BACKENDS: readonly Backend[] = ["module", "functions", "scripts"];

export interface IdemClientOptions {
  /** Which backend to use (default "auto": the first of module, functions, scripts this server offers). */
  backend?: BackendChoice;
  /** Without the module, a duplicate waiting for the holder's answer polls BEGIN: first after this many ms (default 10)... */
  pollFirstMs?: number;
  /** ...then at twice the interval each time, up to this many ms (default 200), never past the holder's lease. */
  pollMaxMs?: number;
  /** Ask BEGIN for packed replays (on until a module from before PACKED refuses it). */
  packedReplies?: boolean;
  /** Bound on each call in ms, its reply included (default: spec/http.json's call_timeout_ms). */
  callTimeoutMs?: number;
  /** Connections kept idle for WAIT (blocking) BEGINs. */
  maxIdleWaiters?: number;
}

/**
 * Client for the idem module. Every call is bounded by `callTimeoutMs` (a command whose reply does not come
 * in time rejects with UnavailableError: nothing is known about its effect). Errors are IdemError: one class
 * per module code, UnavailableError, WritesRefusedError, OtherRedisError.
 *
 * `begin(..., { waitMs })` sends a normal BEGIN first and only when it answers in_flight a blocking one
 * (WAIT) on a connection of its own, so a waiting call never holds up the shared connection. On the library
 * backends (which answer WAIT at once) it polls BEGIN instead, at a growing interval, until its wait is over.
 *
 * The backend is found on the first call (IdemClient.connect finds it before it answers): with "auto", the module
 * where COMMAND INFO IDEM.BEGIN answers an entry, else the Functions library (loaded with FUNCTION LOAD REPLACE
 * when idem_version is missing or older than spec/functions.json's), else scripts (SCRIPT LOAD). A server offering
 * none of them is a NoBackendError saying what to do. A call answered "function not found" (FUNCTION FLUSH, a
 * restart without persistence, a failover) or NOSCRIPT loads the library and is sent once more.
 */
export class IdemClient {
  readonly redis: RedisLike;
  readonly callTimeoutMs: number;
  private packed: boolean;
  private readonly idle: RedisLike[] = [];
  private readonly maxIdle: number;
  private closed = false;
  /** The backend asked for. */
  readonly backendChoice: BackendChoice;
  private resolved: Backend | null = null;
  private resolving: Promise<Backend> | null = null;
  private loading: Promise<void> | null = null;
  private readonly pollFirstMs: number;
  private readonly pollMaxMs: number;
  /** How many times the library was loaded (FUNCTION LOAD or SCRIPT LOAD) by this client. */
  libraryLoads = 0;

  constructor(redis: RedisLike, options: IdemClientOptions = {}) {
    this.redis = redis;
    this.packed = options.packedReplies ?? true;
    this.callTimeoutMs = options.callTimeoutMs ?? defaultCallTimeoutMs();
    this.maxIdle = options.maxIdleWaiters ?? 8;
    const choice = options.backend ?? "auto";
    if (choice !== "auto" && !BACKENDS.includes(choice)) throw new TypeError(`backend ${JSON.stringify(choice)}: use auto, module, functions or scripts`);
    this.backendChoice = choice;
    this.pollFirstMs = Math.max(1, options.pollFirstMs ?? 10);
    this.pollMaxMs = Math.max(this.pollFirstMs, options.pollMaxMs ?? 200);
  }

  /** The backend in use, once found (null before the first call of a client made with `new`). */
  get backend(): Backend | null {
    return this.resolved;
  }

  /**
   * A connected client for the server at `url` (redis://host:port/db). No offline queue: a command while
   * the connection is down fails at once (503) instead of waiting; the connection reconnects by itself.
   */
  static async connect(url: string, options: IdemClientOptions & { redis?: RedisClientOptions } = {}): Promise<IdemClient> {
    const timeout = options.callTimeoutMs ?? defaultCallTimeoutMs();
    let client: ReturnType<typeof createClient>;
    try {
      client = createClient({
        url,
        disableOfflineQueue: true,
        ...options.redis,
        socket: {
          connectTimeout: timeout,
          reconnectStrategy: (retries: number) => Math.min(50 * 2 ** retries, 1000),
          ...options.redis?.socket,
        },
      });
    } catch (err) {
      // A malformed URL: node's URL error carries the whole input (password included) as err.input, so it is
      // not kept as the cause.
      // eslint-disable-next-line preserve-caught-error
      throw new TypeError(`invalid Redis URL ${maskUrl(url)}: ${err instanceof Error ? err.message : String(err)}`);
    }
    // Connection errors surface on the commands; the client reconnects on its own.
    client.on("error", () => undefined);
    try {
      // The first connection must come within the call timeout (node-redis would retry it forever).
      await connectBounded(client, timeout, maskUrl(url));
    } catch (err) {
      client.destroy();
      throw fromRedis(err);
    }
    const idem = new IdemClient(client, { ...options, callTimeoutMs: timeout });
    try {
      await idem.ready();
    } catch (err) {
      client.destroy();
      throw err;
    }
    return idem;
  }

  /**
   * Finds the backend (once; again after a failure): the chosen one, checked, or with "auto" the first this server
   * offers. Throws NoBackendError when there is none, UnavailableError when the server does not answer.
   */
  ready(): Promise<Backend> {
    if (this.resolved !== null) return Promise.resolve(this.resolved);
    this.resolving ??= this.detect().then(
      (backend) => {
        this.resolved = backend;
        return backend;
      },
      (err: unknown) => {
        this.resolving = null;
        throw err;
      },
    );
    return this.resolving;
  }

  async close(): Promise<void> {
    this.closed = true;
    for (const c of this.idle.splice(0)) c.destroy?.();
    if (this.redis.isOpen) await this.redis.close?.();
  }

  // ------------------------------------------------------------ commands

  /**
   * IDEM.BEGIN: new (token), in_flight (retryAfterMs), replay (response) or mismatch. With `waitMs`, a
   * duplicate of a running request waits up to that long for the holder's answer.
   */
  async begin(key: string, fingerprint: Uint8Array, options: BeginOptions): Promise<Outcome> {
    const first = await this.beginOnce(key, fingerprint, options.ttlMs, options.leaseMs, undefined);
    if (first.kind !== "in_flight" || wire.isZero(options.waitMs)) return first;
    if (this.resolved !== "module") return this.poll(key, fingerprint, options, first);
    try {
      return await this.beginOnce(key, fingerprint, options.ttlMs, options.leaseMs, options.waitMs);
    } catch (err) {
      if (!(err instanceof IdemError)) throw err;
      // The key is known to be in flight; that stays the answer.
      return first;
    }
  }

  /**
   * Without the module (WAIT answers at once inside a script): BEGIN again until it answers something else than
   * in_flight or `waitMs` is over, sleeping a growing interval (pollFirstMs doubling up to pollMaxMs) but never
   * past the holder's lease (retry_after), when a takeover becomes possible. The last in_flight when the wait ends.
   */
  private async poll(key: string, fingerprint: Uint8Array, options: BeginOptions, first: InFlight): Promise<Outcome> {
    const deadline = Date.now() + wire.clientMs(options.waitMs ?? 0);
    let last = first;
    let pause = this.pollFirstMs;
    for (;;) {
      const left = deadline - Date.now();
      if (left <= 0 || this.closed) return last;
      await sleep(Math.max(1, Math.min(pause, last.retryAfterMs, left)));
      pause = Math.min(pause * 2, this.pollMaxMs);
      let next: Outcome;
      try {
        next = await this.beginOnce(key, fingerprint, options.ttlMs, options.leaseMs, undefined);
      } catch (err) {
        if (!(err instanceof IdemError)) throw err;
        // The key is known to be in flight; that stays the answer.
        return last;
      }
      if (next.kind !== "in_flight") return next;
      last = next;
    }
  }

  private async beginOnce(
    key: string,
    fingerprint: Uint8Array,
    ttlMs: number,
    leaseMs: number | undefined,
    waitMs: number | undefined,
  ): Promise<Outcome> {
    const fp = Buffer.from(fingerprint);
    const send = (packed: boolean): Promise<unknown> => {
      const args = wire.beginArgs(key, fp, ttlMs, { leaseMs, waitMs, packed });
      return waitMs === undefined ? this.call(args) : this.queryBlocking(args, wire.clientMs(waitMs) + this.callTimeoutMs);
    };
    const packed = this.packed;
    let reply: unknown;
    try {
      reply = await send(packed);
    } catch (err) {
      if (!(packed && err instanceof BadArgError && wire.refusesPacked(err))) throw err;
      this.packed = false;
      reply = await send(false);
    }
    return wire.parseBegin(reply);
  }

  /** IDEM.COMPLETE: stores the response for the holder of `token` ("mirror": it came from Postgres, stored MIRRORED). */
  async complete(key: string, token: bigint, response: StoredResponse, origin: Origin = "handler"): Promise<void> {
    wire.parseOk(await this.call(wire.completeArgs(key, token, response, origin === "mirror")));
  }

  /** IDEM.ABORT: releases the key; false when `token` no longer holds an in-progress record. */
  async abort(key: string, token: bigint): Promise<boolean> {
    wire.checkToken(token);
    return wire.parseAbort(await this.call(wire.abortArgs(key, token)));
  }

  /** IDEM.TOUCH: the holder's lease becomes now + leaseMs; answers the remaining lease in ms. */
  async touch(key: string, token: bigint, leaseMs: number): Promise<number> {
    wire.checkToken(token);
    return wire.parseTouch(await this.call(wire.touchArgs(key, token, leaseMs)));
  }

  /** IDEM.GET: the record, or null. */
  async get(key: string): Promise<KeyRecord | null> {
    return wire.parseRecord(await this.call(wire.getArgs(key)));
  }

  // ------------------------------------------------------------ backends

  /** A module command (IDEM.*) on the backend in use; the library loaded and the call sent once more when the server lost it. */
  private async call(args: wire.Arg[]): Promise<unknown> {
    const backend = await this.ready();
    if (backend === "module") return this.query(args);
    const sent = translate(backend, args);
    try {
      return await this.send(sent);
    } catch (err) {
      if (!missing(backend, err)) throw fromRedis(err);
    }
    await this.reload(backend);
    return this.query(sent);
  }

  /** Loads the library again after the server answered that it lacks it; one load at a time for every call that found out. */
  private reload(backend: "functions" | "scripts"): Promise<void> {
    this.loading ??= this.loadLibrary(backend)
      .catch((err: unknown) => {
        const typed = fromRedis(err);
        if (typed.isUnreachable || typed instanceof NoBackendError) throw typed;
        const how = backend === "functions" ? "FUNCTION LOAD REPLACE" : "SCRIPT LOAD";
        throw new NoBackendError(`the server lost the idem library (FUNCTION FLUSH, a restart without persistence, a failover) and ${how} failed: ${typed.message}`, { cause: typed });
      })
      .finally(() => {
        this.loading = null;
      });
    return this.loading;
  }

  /** FUNCTION LOAD REPLACE (functions) or SCRIPT LOAD (scripts) of the library's source; raw errors. */
  private async loadLibrary(backend: "functions" | "scripts"): Promise<void> {
    let source: string;
    try {
      source = spec.librarySource();
    } catch (err) {
      throw new NoBackendError(`the idem library's source is missing (${spec.libraryPath().pathname}): ${String(err)}`, { cause: err });
    }
    if (backend === "functions") {
      await this.send(["FUNCTION", "LOAD", "REPLACE", source]);
    } else {
      const sha = await this.send(["SCRIPT", "LOAD", scriptBody(source)]);
      const got = Buffer.isBuffer(sha) ? sha.toString() : String(sha);
      if (got !== scriptSha()) throw new NoBackendError(`SCRIPT LOAD answered ${got}, not the library's ${scriptSha()}`);
    }
    this.libraryLoads++;
  }

  /** The library's version as the server answers idem_version, or null when it has no library (or no such script). */
  private async libraryVersion(backend: "functions" | "scripts"): Promise<number | null> {
    const name = spec.functions().functions.version.name;
    const args = backend === "functions" ? ["FCALL", name, "0"] : ["EVALSHA", scriptSha(), "0", name];
    let reply: unknown;
    try {
      reply = await this.send(args);
    } catch (err) {
      if (missing(backend, err)) return null;
      throw err;
    }
    const text = Buffer.isBuffer(reply) ? reply.toString() : String(reply);
    if (!/^[0-9]+$/.test(text)) throw new NoBackendError(`${name} answered ${JSON.stringify(text)}, not a version`);
    return Number(text);
  }

  /**
   * Whether the module is loaded: COMMAND INFO IDEM.BEGIN answers an entry. A user that may not run COMMAND (the
   * documented application user runs only the IDEM.* commands) asks IDEM.GET instead: any answer but "unknown
   * command" (a record, none, NOPERM for the command or the key) means the module is there. True, or why not.
   */
  private async hasModule(): Promise<true | string> {
    let reply: unknown;
    try {
      reply = await this.send(["COMMAND", "INFO", "IDEM.BEGIN"]);
    } catch (err) {
      const refused = passUnreachable(err).message;
      try {
        await this.send(["IDEM.GET", "idem:{backend-probe}"]);
        return true;
      } catch (probe) {
        const answer = passUnreachable(probe).message;
        if (!/^ERR unknown command/i.test(answer)) return true;
        return `COMMAND INFO IDEM.BEGIN failed (${refused}) and IDEM.GET answered ${answer}`;
      }
    }
    if (Array.isArray(reply) && reply.length === 1 && reply[0] !== null && reply[0] !== undefined) return true;
    return "IDEM.BEGIN does not exist (no module loaded)";
  }

  /** The library, loaded when missing or older than this client's: true, or why it cannot be used. */
  private async tryLibrary(backend: "functions" | "scripts"): Promise<true | string> {
    const want = spec.functions().version;
    const call = backend === "functions" ? "FCALL" : "EVALSHA";
    const load = backend === "functions" ? "FUNCTION LOAD REPLACE" : "SCRIPT LOAD";
    let version: number | null;
    try {
      version = await this.libraryVersion(backend);
    } catch (err) {
      return `${call} failed: ${passUnreachable(err).message}`;
    }
    if (version !== null && version >= want) return true;
    const had = version === null ? "no idem library loaded" : `the loaded library is version ${version}, this client needs ${want}`;
    try {
      await this.loadLibrary(backend);
    } catch (err) {
      return `${had}, and ${load} failed: ${passUnreachable(err).message}`;
    }
    try {
      version = await this.libraryVersion(backend);
    } catch (err) {
      return `${call} after ${load} failed: ${passUnreachable(err).message}`;
    }
    if (version === null || version < want) return `after ${load} the library answers version ${String(version)}, this client needs ${want}`;
    return true;
  }

  private async detect(): Promise<Backend> {
    const choice = this.backendChoice;
    const reasons: string[] = [];
    for (const backend of BACKENDS) {
      if (choice !== "auto" && choice !== backend) continue;
      const found = backend === "module" ? await this.hasModule() : await this.tryLibrary(backend);
      if (found === true) return backend;
      reasons.push(`${backend}: ${found}`);
    }
    const what =
      choice === "auto"
        ? "this Redis has no idem"
        : `backend ${JSON.stringify(choice)} was chosen and this Redis cannot run it`;
    throw new NoBackendError(
      `${what} (${reasons.join("; ")}). Load the module (redis-server --loadmodule /path/to/libidem.so), or let this ` +
        "client's user run FUNCTION LOAD and FCALL (Redis 7 or later) or SCRIPT LOAD and EVALSHA (Redis 6), or have an " +
        "operator load the library once: redis-cli -x FUNCTION LOAD REPLACE < functions/idem.lua",
    );
  }

  // ------------------------------------------------------------ transport

  /** One command on the shared connection, bounded by callTimeoutMs; errors as node-redis throws them. */
  private send(args: wire.Arg[]): Promise<unknown> {
    return this.redis.sendCommand(args, { typeMapping: TYPE_MAPPING, timeout: this.callTimeoutMs, rejectInFlight: true });
  }

  private async query(args: wire.Arg[]): Promise<unknown> {
    try {
      return await this.send(args);
    } catch (err) {
      throw fromRedis(err);
    }
  }

  /** One blocking command on a connection of its own, for at most `boundMs`; a connection that gave no answer is dropped. */
  private async queryBlocking(args: wire.Arg[], boundMs: number): Promise<unknown> {
    let conn = this.idle.pop();
    if (conn === undefined || !conn.isOpen) {
      conn = this.redis.duplicate();
      (conn as unknown as { on?: (e: string, f: () => void) => void }).on?.("error", () => undefined);
      try {
        await connectBounded(conn, this.callTimeoutMs, "a waiting connection");
      } catch (err) {
        conn.destroy?.();
        throw fromRedis(err);
      }
    }
    let healthy = false;
    try {
      const reply = await withTimeout(conn.sendCommand(args, { typeMapping: TYPE_MAPPING }), boundMs);
      healthy = true;
      return reply;
    } catch (err) {
      const typed = fromRedis(err);
      healthy = !(typed instanceof UnavailableError) && conn.isOpen;
      throw typed;
    } finally {
      if (healthy && !this.closed && this.idle.length < this.maxIdle) this.idle.push(conn);
      else conn.destroy?.();
    }
  }
}

const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * A transport failure goes on as UnavailableError (nothing is known yet); any answer of the server is a reason, as
 * text: its code word kept, an unknown command's echo of its arguments (the whole library, for FUNCTION LOAD) left out.
 */
function passUnreachable(err: unknown): { message: string } {
  const typed = fromRedis(err);
  if (typed.isUnreachable) throw typed;
  const text = typed.code !== null ? `${typed.code} ${typed.detail}` : typed.message;
  return { message: text.replace(/, with args beginning with: [\s\S]*$/, "") };
}

/** Whether the server answered that it lacks the library (ERR Function not found) or the script (NOSCRIPT). */
function missing(backend: "functions" | "scripts", err: unknown): boolean {
  if (!(err instanceof ErrorReply)) return false;
  const e = spec.functions().errors;
  return err.message.startsWith(backend === "functions" ? e.missing_function : e.missing_script);
}

let functionNames: Map<string, { name: string; keys: number }> | undefined;

/** A module command as the library's call: FCALL name numkeys keys... args..., or EVALSHA sha numkeys keys... name args... */
export function translate(backend: "functions" | "scripts", args: wire.Arg[]): wire.Arg[] {
  functionNames ??= new Map(
    Object.values(spec.functions().functions)
      .filter((f) => f.module !== null)
      .map((f) => [f.module as string, { name: f.name, keys: f.keys.length }]),
  );
  const [command, key, ...rest] = args;
  const f = functionNames.get(String(command));
  if (f === undefined || key === undefined) throw new TypeError(`no library function for ${String(command)}`);
  // idem_complete's second key is the record's outbox, in the record key's slot.
  const keys = f.keys === 2 ? [key, outboxKey(typeof key === "string" ? key : Buffer.from(key))] : [key];
  if (backend === "functions") return ["FCALL", f.name, String(keys.length), ...keys, ...rest];
  return ["EVALSHA", scriptSha(), String(keys.length), ...keys, f.name, ...rest];
}

/** The scripts form: the library's source without its first line (the #!lua shebang). */
export function scriptBody(source: string): string {
  const nl = source.indexOf("\n");
  return nl < 0 ? "" : source.slice(nl + 1);
}

let sha: string | undefined;
/** The SHA-1 EVALSHA names the scripts form by. */
export function scriptSha(): string {
  sha ??= createHash("sha1").update(scriptBody(spec.librarySource())).digest("hex");
  return sha;
}

/** `url` with its password (and a user's name before it, when given) replaced by "***", also when it does not parse. */
export function maskUrl(url: string): string {
  return url.replace(/^([a-z][a-z0-9+.-]*:\/\/[^/?#@]*?:)[^/?#]*@/i, "$1***@").replace(/^([a-z][a-z0-9+.-]*:\/\/)([^/?#:@]+)@/i, "$1***@");
}

/** Whether a socket error is TLS refusing the peer (its certificate, its host name) or the peer refusing us: a configuration error, never an outage. */
export function isTlsFailure(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const code = (err as { code?: unknown }).code;
  if (typeof code === "string" && /^(ERR_TLS_|ERR_SSL_|ERR_OSSL_|CERT_|UNABLE_TO_|DEPTH_ZERO_SELF_SIGNED_CERT|SELF_SIGNED_CERT_IN_CHAIN|HOSTNAME_MISMATCH)/.test(code)) return true;
  return (err as { library?: unknown }).library === "SSL routines";
}

interface Connectable {
  connect(): Promise<unknown>;
  on?(event: "error", listener: (err: unknown) => void): unknown;
  off?(event: "error", listener: (err: unknown) => void): unknown;
}

/**
 * The first connection, within `ms`: a TLS failure (a certificate not trusted, a host name it does not name, a
 * client certificate the server wants) fails at once with its own text, as OtherRedisError (fail closed: never
 * retried as an outage); any other failure is retried until `ms`, then UnavailableError with the last error's text.
 */
async function connectBounded(client: Connectable, ms: number, what: string): Promise<void> {
  let last: unknown;
  let fail: (err: unknown) => void = () => undefined;
  const tls = new Promise<never>((_, reject) => {
    fail = reject;
  });
  const listener = (err: unknown): void => {
    last = err;
    if (isTlsFailure(err)) {
      const code = (err as { code?: unknown }).code;
      fail(new OtherRedisError(`TLS to ${what} failed: ${(err as Error).message.trim()}${typeof code === "string" ? ` (${code})` : ""}`, { cause: err }));
    }
  };
  client.on?.("error", listener);
  try {
    await withTimeout(Promise.race([client.connect(), tls]), ms, () => {
      // TLS 1.3 sends "certificate required" after the handshake: the client may see only the reset that follows.
      if (what.startsWith("rediss://") && last instanceof Error && (last as { code?: unknown }).code === "ECONNRESET") {
        return new Error(`${last.message}: the server ended the TLS connection; does it want a client certificate?`, { cause: last });
      }
      return last;
    });
  } finally {
    client.off?.("error", listener);
  }
}

function withTimeout<T>(promise: Promise<T>, ms: number, lastError: () => unknown = () => undefined): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => {
      const last = lastError();
      const why = last instanceof Error ? ` (last error: ${last.message || last.name})` : "";
      reject(new UnavailableError(`no answer within ${ms} ms${why}`, last === undefined ? undefined : { cause: last }));
    }, ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}
