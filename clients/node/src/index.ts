// idem-client: the Node client of the idem Redis module (IDEM.* commands,
// typed outcomes and errors, fingerprints, Postgres read-through and the
// two-phase fence, and the framework-neutral Idempotency-Key flow; the
// Express middleware is `idem-client/express`, the Fastify plugin
// `idem-client/fastify`).
export {
  IdemClient,
  BACKENDS,
  defaultCallTimeoutMs,
  isTlsFailure,
  maskUrl,
  scriptBody,
  scriptSha,
  translate,
  type Backend,
  type BackendChoice,
  type IdemClientOptions,
  type RedisLike,
} from "./client.js";
export { crc16, hashTag, outboxKey, slot, SLOTS } from "./slot.js";
export * from "./errors.js";
export * from "./types.js";
export { canonicalize, formatDouble, MAX_DEPTH } from "./canonicalJson.js";
export { Fingerprinter, downstreamKey, downstreamKeyOf, isJsonContentType, storedHex, type FingerprinterOptions, type HeaderPairs } from "./fingerprint.js";
export {
  checkTenant,
  InvalidKeyError,
  InvalidTenantError,
  MAX_KEY_BYTES,
  MAX_TENANT_BYTES,
  parseKey,
  parseValue,
  redisKey,
  tenantOfLines,
  type KeyErrorKind,
  type TenantProblem,
} from "./keys.js";
export { ReadThrough, decodeRow, type MirroredRecord } from "./readThrough.js";
export { Fence, FenceReport, decide, type Claim, type Committed, type FenceOptions, type Held, type Layout, type Lost, type Proceed } from "./fence.js";
export {
  Idempotency,
  Run,
  defaultStorePolicy,
  problem,
  problemBody,
  replayResponse,
  retryAfterHeader,
  type HttpRequest,
  type HttpResponse,
  type IdempotencyContext,
  type IdempotencyOptions,
  type Logger,
  type Start,
} from "./middleware.js";
export * as wire from "./wire.js";
export * as spec from "./spec.js";
