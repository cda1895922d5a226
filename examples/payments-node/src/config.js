// @ts-check
// Settings from the environment, the same variables, defaults and refusals
// as examples/payments-api/src/config.rs: REDIS_URL, DATABASE_URL, PORT,
// READ_THROUGH, WAIT_MS, LEASE_MS, PG_POOL_SIZE, PROCESSOR_DELAY_MS, FENCE,
// API_TOKENS;
// and BACKEND (auto, module, functions or scripts: where idem runs);
// REDIS_CA_CERT, REDIS_CLIENT_CERT and REDIS_CLIENT_KEY (PEM files, for a
// rediss:// REDIS_URL). Postgres takes its TLS settings in DATABASE_URL as
// libpq does (sslmode, sslrootcert, sslcert, sslkey).

/**
 * @typedef {object} Settings
 * @property {string} redisUrl
 * @property {string} databaseUrl
 * @property {number} port The API listens on 127.0.0.1:port.
 * @property {boolean} readThrough
 * @property {number | null} waitMs Duplicates wait this long for the original's answer (off when null).
 * @property {number} leaseMs
 * @property {number} poolSize
 * @property {number} processorDelayMs Simulated payment-processor latency per new payment (0 = none).
 * @property {boolean} fence Commit each new payment with its idempotency row (default: on).
 * @property {"auto" | "module" | "functions" | "scripts"} backend Where idem runs (default auto: the module, else the library).
 * @property {{ ca: string | null, cert: string | null, key: string | null }} redisTls PEM files for TLS to Redis: a CA to trust
 *   (besides the platform's) and a client certificate with its key.
 * @property {Map<string, string>} tokens API_TOKENS="tok_a=acct_1,tok_b=acct_2": the bearer tokens callers authenticate
 *   with and the account each maps to (default: DEMO_TOKENS).
 */

/** The bearer tokens used when API_TOKENS is unset (scripts/up.sh, the conformance suite), as in the Rust service: never deploy them. */
export const DEMO_TOKENS = "tok_demo=acct_demo,tok_a=acct_a,tok_b=acct_b";

/**
 * `token=account` pairs separated by commas (spaces around either dropped); an empty token or account, a token given
 * twice, or no pair at all is refused.
 * @param {string} table
 * @returns {Map<string, string>}
 */
export function parseTokens(table) {
  const tokens = new Map();
  for (const pair of table.split(",").map((p) => p.trim())) {
    if (pair === "") continue;
    const eq = pair.indexOf("=");
    if (eq < 0) throw new SettingsError(`API_TOKENS: ${JSON.stringify(pair)} is not token=account`);
    const token = pair.slice(0, eq).trim();
    const account = pair.slice(eq + 1).trim();
    if (token === "" || account === "") throw new SettingsError(`API_TOKENS: ${JSON.stringify(pair)} has an empty token or account`);
    if (tokens.has(token)) throw new SettingsError("API_TOKENS: a token is given twice");
    tokens.set(token, account);
  }
  if (tokens.size === 0) throw new SettingsError("API_TOKENS has no token=account pair");
  return tokens;
}

const BACKENDS = ["auto", "module", "functions", "scripts"];

/** A bad setting; its message names the variable as the Rust service does. */
export class SettingsError extends Error {}

const U64_MAX = (1n << 64n) - 1n;

/**
 * An unsigned integer as Rust's `str::parse` reads one (an optional `+`, digits), at most `max`.
 * @param {string} text
 * @param {bigint} max
 * @returns {bigint | null}
 */
function unsigned(text, max) {
  if (!/^\+?[0-9]+$/.test(text)) return null;
  const n = BigInt(text);
  return n <= max ? n : null;
}

/**
 * @param {(name: string) => string | undefined} get
 * @returns {Settings}
 */
export function fromLookup(get) {
  const redisUrl = get("REDIS_URL") ?? "redis://127.0.0.1:6390/";
  const databaseUrl = get("DATABASE_URL");
  if (databaseUrl === undefined) throw new SettingsError("DATABASE_URL is not set");
  const p = get("PORT");
  let port = 8080;
  if (p !== undefined) {
    const n = unsigned(p, 65535n);
    if (n === null) throw new SettingsError(`PORT=${JSON.stringify(p)} is not a port`);
    port = Number(n);
  }
  const readThrough = toggle(get, "READ_THROUGH");
  const fence = toggle(get, "FENCE");
  const wait = millis(get, "WAIT_MS");
  const lease = millis(get, "LEASE_MS");
  const s = get("PG_POOL_SIZE");
  let poolSize = 16;
  if (s !== undefined) {
    const n = unsigned(s, U64_MAX);
    if (n === null) throw new SettingsError(`PG_POOL_SIZE=${JSON.stringify(s)} is not a number`);
    poolSize = Number(n);
  }
  const delay = millis(get, "PROCESSOR_DELAY_MS");
  const b = get("BACKEND") ?? "auto";
  if (!BACKENDS.includes(b)) throw new SettingsError(`BACKEND=${JSON.stringify(b)}: use ${BACKENDS.join(", ")}`);
  const backend = /** @type {Settings["backend"]} */ (b);
  const redisTls = { ca: get("REDIS_CA_CERT") ?? null, cert: get("REDIS_CLIENT_CERT") ?? null, key: get("REDIS_CLIENT_KEY") ?? null };
  if ((redisTls.cert === null) !== (redisTls.key === null)) throw new SettingsError("REDIS_CLIENT_CERT and REDIS_CLIENT_KEY go together");
  if ((redisTls.ca !== null || redisTls.cert !== null) && !redisUrl.startsWith("rediss://")) {
    throw new SettingsError(`${redisTls.ca !== null ? "REDIS_CA_CERT" : "REDIS_CLIENT_CERT"} needs a rediss:// REDIS_URL`);
  }
  const tokens = parseTokens(get("API_TOKENS") ?? DEMO_TOKENS);
  return {
    tokens,
    redisUrl,
    databaseUrl,
    port,
    readThrough,
    waitMs: wait === null || wait === 0 ? null : wait,
    leaseMs: lease ?? 30_000,
    poolSize,
    processorDelayMs: delay ?? 0,
    fence,
    backend,
    redisTls,
  };
}

/** @returns {Settings} */
export function fromEnv() {
  return fromLookup((name) => process.env[name]);
}

/**
 * An on/off setting, on when unset.
 * @param {(name: string) => string | undefined} get
 * @param {string} name
 */
function toggle(get, name) {
  const v = get(name);
  if (v === undefined || v === "1" || v === "true" || v === "on") return true;
  if (v === "0" || v === "false" || v === "off") return false;
  throw new SettingsError(`${name}=${JSON.stringify(v)}: use on or off`);
}

/**
 * @param {(name: string) => string | undefined} get
 * @param {string} name
 * @returns {number | null}
 */
function millis(get, name) {
  const v = get(name);
  if (v === undefined) return null;
  const n = unsigned(v, U64_MAX);
  if (n === null) throw new SettingsError(`${name}=${JSON.stringify(v)} is not a number of milliseconds`);
  return Number(n);
}
