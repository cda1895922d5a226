// One Express payments endpoint behind one idempotency layer, for the peer
// benchmark (run.mjs): MODE=idem (idem-client's Express middleware over the
// module) or MODE=powertools (@aws-lambda-powertools/idempotency's
// makeIdempotent with its Redis CachePersistenceLayer over node-redis), on
// REDIS_URL, listening on 127.0.0.1:PORT. The handler counts its executions
// per key (GET /stats), sleeps DELAY_MS (or ?ms=), and answers 500 once per
// key with ?fail=1; VALIDATE=1 turns Powertools' payload validation on. Both layers get a 1 s lease (LEASE_MS) for a running
// request: idem's LEASE, Powertools' in-progress expiry from a Lambda-style
// remaining time.
import express from "express";
import { createClient } from "@redis/client";
import { IdemClient } from "idem-client";
import { idempotency } from "idem-client/express";
import { makeIdempotent, IdempotencyConfig, IdempotencyAlreadyInProgressError, IdempotencyValidationError } from "@aws-lambda-powertools/idempotency";
import { CachePersistenceLayer } from "@aws-lambda-powertools/idempotency/cache";

const { MODE, REDIS_URL, PORT } = process.env;
const DELAY_MS = Number(process.env.DELAY_MS ?? 0);
const LEASE_MS = Number(process.env.LEASE_MS ?? 1000);
const executions = new Map();
const failed = new Set();

/** The business logic: one execution (a "charge") per run. */
async function charge(key, body, ms, fail) {
  executions.set(key, (executions.get(key) ?? 0) + 1);
  if (ms > 0) await new Promise((resolve) => setTimeout(resolve, ms));
  if (fail && !failed.has(key)) {
    failed.add(key);
    throw new Error("processor down");
  }
  return { status: 201, body: { id: `${key}:${process.pid}:${executions.get(key)}`, amount: body.amount ?? null } };
}

const app = express();
app.get("/stats", (_req, res) => res.json({ executions: Object.fromEntries(executions) }));
const keyOf = (req) => String(req.headers["idempotency-key"] ?? "");
const msOf = (req) => Number(req.query.ms ?? DELAY_MS);

if (MODE === "idem") {
  const client = await IdemClient.connect(REDIS_URL);
  app.use(idempotency({ client, leaseMs: LEASE_MS, logger: { warn: () => undefined, error: () => undefined } }));
  app.post("/payments", async (req, res) => {
    try {
      const out = await charge(keyOf(req), req.body ?? {}, msOf(req), req.query.fail === "1");
      res.status(out.status).json(out.body);
    } catch {
      res.status(500).json({ error: "internal" });
    }
  });
} else if (MODE === "powertools") {
  const redis = createClient({ url: REDIS_URL });
  await redis.connect();
  // VALIDATE=1 turns Powertools' payload validation on (a reused key with another body is refused).
  const validation = process.env.VALIDATE === "1" ? { payloadValidationJmesPath: "body" } : {};
  const config = new IdempotencyConfig({ eventKeyJmesPath: "key", expiresAfterSeconds: 86400, ...validation });
  const run = makeIdempotent(async (event) => charge(event.key, event.body, event.ms, event.fail), {
    persistenceStore: new CachePersistenceLayer({ client: redis }),
    config,
  });
  app.post("/payments", express.json(), async (req, res) => {
    config.registerLambdaContext({ getRemainingTimeInMillis: () => LEASE_MS });
    try {
      const out = await run({ key: keyOf(req), body: req.body ?? {}, ms: msOf(req), fail: req.query.fail === "1" });
      res.status(out.status).json(out.body);
    } catch (err) {
      if (err instanceof IdempotencyAlreadyInProgressError) res.status(409).json({ error: "in_progress" });
      else if (err instanceof IdempotencyValidationError) res.status(422).json({ error: "mismatch" });
      else res.status(500).json({ error: "internal" });
    }
  });
} else {
  throw new Error(`MODE=${MODE}: use idem or powertools`);
}

app.listen(Number(PORT), "127.0.0.1", () => process.stdout.write("ready\n"));
