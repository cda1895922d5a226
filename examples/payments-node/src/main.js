// @ts-check
// payments-node: the example payments API on 127.0.0.1:$PORT, the Node twin
// of examples/payments-api (same HTTP API, tables, processor simulation and
// environment; see config.js). Exits non-zero with the reason on stderr when
// a setting is bad or Redis or Postgres cannot be reached at start.
import { readFileSync } from "node:fs";
import { IdemClient, ReadThrough } from "idem-client";
import { fromEnv, SettingsError } from "./config.js";
import * as db from "./db.js";
import { Processor } from "./processor.js";
import { buildApp } from "./app.js";

const log = (/** @type {string} */ msg) => process.stderr.write(`${new Date().toISOString()} ${msg}\n`);

async function main() {
  const settings = fromEnv();
  const pool = db.pool(settings.databaseUrl, settings.poolSize);
  try {
    await db.migrate(pool);
  } catch (err) {
    throw new Error(`migrate: ${String(err)}`, { cause: err });
  }
  /** @type {Record<string, Buffer>} */
  const tls = {};
  /** @type {[string, string, string | null][]} */
  const files = [["ca", "REDIS_CA_CERT", settings.redisTls.ca], ["cert", "REDIS_CLIENT_CERT", settings.redisTls.cert], ["key", "REDIS_CLIENT_KEY", settings.redisTls.key]];
  for (const [name, variable, path] of files) {
    if (path === null) continue;
    try {
      tls[name] = readFileSync(path);
    } catch (err) {
      throw new SettingsError(`${variable}=${JSON.stringify(path)}: ${err instanceof Error ? err.message : String(err)}`);
    }
  }
  let client;
  try {
    const redis = Object.keys(tls).length > 0 ? { socket: { tls: /** @type {const} */ (true), ...tls } } : undefined;
    client = await IdemClient.connect(settings.redisUrl, { backend: settings.backend, ...(redis !== undefined ? { redis } : {}) });
  } catch (err) {
    throw new Error(`connect to Redis: ${String(err)}`, { cause: err });
  }
  const state = { db: pool, processor: new Processor(pool, settings.processorDelayMs), fence: settings.fence, ids: new db.PaymentIds(), log };
  const app = await buildApp(state, {
    client,
    leaseMs: settings.leaseMs,
    ...(settings.readThrough ? { readThrough: new ReadThrough(pool) } : {}),
    // Every keyed route's handler uses the fence: its claim stands in for read-through's lookup (one statement
    // fewer per payment), as in the Rust and Python examples.
    claimUpFront: settings.fence && settings.readThrough,
    ...(settings.waitMs !== null ? { waitForResultMs: settings.waitMs } : {}),
    logger: { warn: log, error: log },
  }, settings.tokens);
  await app.listen({ host: "127.0.0.1", port: settings.port });
  log(`payments API listening on http://127.0.0.1:${settings.port} (backend=${client.backend}, read_through=${settings.readThrough}, fence=${settings.fence}, claim_up_front=${settings.fence && settings.readThrough})`);
  let stopping = false;
  const stop = async () => {
    if (stopping) return;
    stopping = true;
    log("shutting down");
    await app.close();
    await client.close().catch(() => undefined);
    await pool.end().catch(() => undefined);
    process.exit(0);
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
}

main().catch((err) => {
  process.stderr.write(`Error: ${err instanceof SettingsError || err instanceof Error ? err.message : String(err)}\n`);
  process.exit(1);
});
