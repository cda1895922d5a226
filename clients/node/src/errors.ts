// Typed errors: one class per module error code (the codes come from
// spec/errors.json at run time, shared with the Rust and Python clients),
// plus "the store is unreachable", "writes refused for now", any other Redis
// error, an unexpected reply, and Postgres. The three questions a caller
// asks, as in the Rust client: isUnavailable (answer 503), isUnreachable (the
// subset a fail-open caller runs the handler on), isTransient (a produced
// response is retried, never released; also OOM).
import { ErrorReply } from "@redis/client";
import * as spec from "./spec.js";

/** Everything a call to the module (or to Postgres for the fence and read-through) can fail with. */
export class IdemError extends Error {
  readonly detail: string;
  protected readonly unreachable: boolean = false;
  protected readonly writesRefused: boolean = false;

  constructor(detail: string, options?: { cause?: unknown }) {
    super(detail, options);
    this.detail = detail;
    this.name = new.target.name;
  }

  /** The store could not be reached or did not answer: fail-open runs the handler. */
  get isUnreachable(): boolean {
    return this.unreachable;
  }
  /** Answer 503: unreachable, or a primary refusing writes for now. */
  get isUnavailable(): boolean {
    return this.unreachable || this.writesRefused;
  }
  /** The store may take a write it refused a moment later. */
  get isTransient(): boolean {
    return this.isUnavailable;
  }
  /** The module's error code, for errors the module answered. */
  get code(): string | null {
    return null;
  }
}

/** An error reply of the idem module; `code` is its code word (spec/errors.json). */
export class ModuleError extends IdemError {
  static readonly CODE: string = "";
  override get code(): string {
    return (this.constructor as typeof ModuleError).CODE;
  }
  override get isTransient(): boolean {
    return spec.errors().transient_codes.includes(this.code);
  }
  override toString(): string {
    return `${this.code}: ${this.detail}`;
  }
}

/** BADARG: malformed or out-of-range argument. */
export class BadArgError extends ModuleError {
  static override readonly CODE = "BADARG";
}
/** STALE: the token is no longer the holder's (the key was taken over). */
export class StaleError extends ModuleError {
  static override readonly CODE = "STALE";
}
/** NOTFOUND: no record under the key. */
export class NotFoundError extends ModuleError {
  static override readonly CODE = "NOTFOUND";
}
/** COMPLETED: the record is completed and can no longer change. */
export class CompletedError extends ModuleError {
  static override readonly CODE = "COMPLETED";
}
/** TOOLARGE: body plus headers exceed the module's max-body-bytes. */
export class TooLargeError extends ModuleError {
  static override readonly CODE = "TOOLARGE";
}
/** WRONGTYPE: the key holds a value that is not an idem record. */
export class WrongTypeError extends ModuleError {
  static override readonly CODE = "WRONGTYPE";
}
/** CORRUPT: the stored value could not be decoded. */
export class CorruptError extends ModuleError {
  static override readonly CODE = "CORRUPT";
}
/** NOPERM: the connection's ACL user may not run the command. */
export class NoPermError extends ModuleError {
  static override readonly CODE = "NOPERM";
}
/** OOM: Redis is above maxmemory; transient. */
export class OomError extends ModuleError {
  static override readonly CODE = "OOM";
}
/** INTERNAL: the module caught a bug at its command boundary. */
export class InternalError extends ModuleError {
  static override readonly CODE = "INTERNAL";
}

/** Redis could not be reached or did not answer in time, or is down for now: nothing is known about the command's effect. */
export class UnavailableError extends IdemError {
  protected override readonly unreachable = true;
}
/** NOREPLICAS or MISCONF: the primary answers but refuses writes for now (503, never fail-open). */
export class WritesRefusedError extends IdemError {
  protected override readonly writesRefused = true;
}
/** Any other Redis error (refused credentials or settings, an unknown code): 500, never fail-open. */
export class OtherRedisError extends IdemError {}
/**
 * The server has no idem: neither the module (IDEM.BEGIN) nor a Functions library or script the client may load
 * (FUNCTION LOAD or SCRIPT LOAD refused or renamed away). Found when the client starts (IdemClient.connect) or on
 * its first call; the message says what was tried and what to do. Answered 503, never fail-open: the store is
 * reachable but cannot keep keys until an operator acts.
 */
export class NoBackendError extends IdemError {
  protected override readonly writesRefused = true;
}
/** The module answered something this client does not understand. */
export class UnexpectedReplyError extends IdemError {}
/** Postgres could not be read or written (read-through, the fence). */
export class PostgresError extends IdemError {
  protected override readonly unreachable = true;
}

const CLASSES = [
  BadArgError,
  StaleError,
  NotFoundError,
  CompletedError,
  TooLargeError,
  WrongTypeError,
  CorruptError,
  NoPermError,
  OomError,
  InternalError,
];

/** One class per module error code, keyed by its code word; checked against spec/errors.json on load. */
export const MODULE_ERRORS: ReadonlyMap<string, new (detail: string) => ModuleError> = (() => {
  const codes = spec.errors().module_codes;
  const byCode = new Map(CLASSES.map((cls) => [cls.CODE, cls]));
  if (codes.length !== CLASSES.length) {
    throw new Error(`idem: ${CLASSES.length} error classes, spec/errors.json has ${codes.length} codes`);
  }
  for (const entry of codes) {
    const cls = byCode.get(entry.code);
    if (cls === undefined || cls.name !== `${entry.name}Error`) {
      throw new Error(`idem: no class ${entry.name}Error for the module code ${entry.code}`);
    }
  }
  return byCode;
})();

/** The error reply's code word and the rest of its text. */
function codeOf(message: string): [string | null, string] {
  const space = message.indexOf(" ");
  const word = space < 0 ? message : message.slice(0, space);
  if (word !== "" && /^[A-Z]+$/.test(word)) return [word, space < 0 ? "" : message.slice(space + 1)];
  return [null, message];
}

/** Whether `err` is an error reply of the server (node-redis' ErrorReply and its kin). */
function isErrorReply(err: Error): boolean {
  return err instanceof ErrorReply;
}

/** The typed error for what the Redis client threw (an error reply, a socket or timeout error). */
export function fromRedis(err: unknown): IdemError {
  if (err instanceof IdemError) return err;
  if (!(err instanceof Error)) return new OtherRedisError(String(err));
  const s = spec.errors();
  if (isErrorReply(err)) {
    const [code, detail] = codeOf(err.message);
    const cls = code === null ? undefined : MODULE_ERRORS.get(code);
    if (cls !== undefined) return new cls(detail);
    if (code !== null && s.writes_refused_codes.includes(code)) return new WritesRefusedError(err.message, { cause: err });
    if (code !== null && s.unavailable_codes.includes(code)) return new UnavailableError(err.message, { cause: err });
    return new OtherRedisError(err.message, { cause: err });
  }
  // Anything else is the transport: closed, refused, timed out, not connected.
  return new UnavailableError(err.message || err.name, { cause: err });
}
