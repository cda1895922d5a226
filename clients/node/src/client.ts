// IdemClient: the IDEM.* commands over a node-redis client (@redis/client).
// node-redis was measured against ioredis on this project's machine and
// chosen for its throughput (clients/node/README.md, "Why node-redis").
import { createClient, RESP_TYPES, type RedisClientOptions } from "@redis/client";
import * as spec from "./spec.js";
import * as wire from "./wire.js";
import { IdemError, BadArgError, UnavailableError, fromRedis } from "./errors.js";
import type { BeginOptions, KeyRecord, Origin, Outcome, StoredResponse } from "./types.js";

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

export interface IdemClientOptions {
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
 * (WAIT) on a connection of its own, so a waiting call never holds up the shared connection.
 */
export class IdemClient {
  readonly redis: RedisLike;
  readonly callTimeoutMs: number;
  private packed: boolean;
  private readonly idle: RedisLike[] = [];
  private readonly maxIdle: number;
  private closed = false;

  constructor(redis: RedisLike, options: IdemClientOptions = {}) {
    this.redis = redis;
    this.packed = options.packedReplies ?? true;
    this.callTimeoutMs = options.callTimeoutMs ?? defaultCallTimeoutMs();
    this.maxIdle = options.maxIdleWaiters ?? 8;
  }

  /**
   * A connected client for the server at `url` (redis://host:port/db). No offline queue: a command while
   * the connection is down fails at once (503) instead of waiting; the connection reconnects by itself.
   */
  static async connect(url: string, options: IdemClientOptions & { redis?: RedisClientOptions } = {}): Promise<IdemClient> {
    const timeout = options.callTimeoutMs ?? defaultCallTimeoutMs();
    const client = createClient({
      url,
      disableOfflineQueue: true,
      ...options.redis,
      socket: {
        connectTimeout: timeout,
        reconnectStrategy: (retries: number) => Math.min(50 * 2 ** retries, 1000),
        ...options.redis?.socket,
      },
    });
    // Connection errors surface on the commands; the client reconnects on its own.
    client.on("error", () => undefined);
    try {
      // The first connection must come within the call timeout (node-redis would retry it forever).
      await withTimeout(client.connect(), timeout);
    } catch (err) {
      client.destroy();
      throw fromRedis(err);
    }
    return new IdemClient(client, { ...options, callTimeoutMs: timeout });
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
    try {
      return await this.beginOnce(key, fingerprint, options.ttlMs, options.leaseMs, options.waitMs);
    } catch (err) {
      if (!(err instanceof IdemError)) throw err;
      // The key is known to be in flight; that stays the answer.
      return first;
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
      return waitMs === undefined ? this.query(args) : this.queryBlocking(args, wire.clientMs(waitMs) + this.callTimeoutMs);
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
    wire.parseOk(await this.query(wire.completeArgs(key, token, response, origin === "mirror")));
  }

  /** IDEM.ABORT: releases the key; false when `token` no longer holds an in-progress record. */
  async abort(key: string, token: bigint): Promise<boolean> {
    wire.checkToken(token);
    return wire.parseAbort(await this.query(wire.abortArgs(key, token)));
  }

  /** IDEM.TOUCH: the holder's lease becomes now + leaseMs; answers the remaining lease in ms. */
  async touch(key: string, token: bigint, leaseMs: number): Promise<number> {
    wire.checkToken(token);
    return wire.parseTouch(await this.query(wire.touchArgs(key, token, leaseMs)));
  }

  /** IDEM.GET: the record, or null. */
  async get(key: string): Promise<KeyRecord | null> {
    return wire.parseRecord(await this.query(wire.getArgs(key)));
  }

  // ------------------------------------------------------------ transport

  private async query(args: wire.Arg[]): Promise<unknown> {
    try {
      return await this.redis.sendCommand(args, { typeMapping: TYPE_MAPPING, timeout: this.callTimeoutMs, rejectInFlight: true });
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
        await withTimeout(conn.connect(), this.callTimeoutMs);
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

function withTimeout<T>(promise: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new UnavailableError(`no answer within ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}
