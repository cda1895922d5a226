// @ts-check
// The example's Postgres side: the pool, the schema (the writer's
// idempotency_keys from crates/idem-writer/migrations, applied and recorded
// as the writer applies them, then the payments table and the processor's
// ledger, the DDL of examples/payments-api/src/db.rs and processor.rs), its
// queries, and the fenced payment's row made before it is written (ids
// reserved ahead, the application's clock).
import { readdirSync, readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import pg from "pg";

/** The writer's migrations, read from the repository: `NNNN_name.sql` is version NNNN named `name`. */
export const WRITER_MIGRATIONS = fileURLToPath(new URL("../../../crates/idem-writer/migrations/", import.meta.url));

/** The writer's advisory lock serialising migrations ("idemwrit", MIGRATION_LOCK_ID of the writer's migrations module). */
export const WRITER_MIGRATION_LOCK = "7594306392483326324"; // 0x6964656d77726974

/** The example's advisory lock serialising its migration ("payments", examples/payments-api/src/db.rs MIGRATION_LOCK_ID). */
export const MIGRATION_LOCK = "8097887115748996211"; // 0x7061796d656e7473

export const CREATE_PAYMENTS = `CREATE TABLE IF NOT EXISTS payments (
    id         BIGSERIAL   PRIMARY KEY,
    amount     BIGINT      NOT NULL CHECK (amount > 0),
    currency   TEXT        NOT NULL,
    recipient  TEXT        NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
)`;

export const CREATE_CHARGES = `CREATE TABLE IF NOT EXISTS processor_charges (
    id              BIGSERIAL   PRIMARY KEY,
    idempotency_key TEXT        NOT NULL UNIQUE,
    amount          BIGINT      NOT NULL,
    currency        TEXT        NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
)`;

/** created_at as RFC 3339 UTC with microseconds, formatted by Postgres. */
const CREATED_AT = `to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`;
const COLUMNS = `id, amount, currency, recipient, ${CREATED_AT} AS created_at`;
const INSERT = `INSERT INTO payments (amount, currency, recipient) VALUES ($1, $2, $3) RETURNING ${COLUMNS}`;
const FIND = `SELECT ${COLUMNS} FROM payments WHERE id = $1`;

/**
 * The fenced payment's row, its values all known beforehand (the id reserved, the time the application's), as the
 * effect of Fence.commitEffect: parameters from $7, the fence's own first (examples/payments-api/src/db.rs).
 */
export const INSERT_FENCED = "INSERT INTO payments (id, amount, currency, recipient, created_at) VALUES ($7, $8, $9, $10, $11)";

/** How many ids PaymentIds reserves per round trip. */
export const RESERVED_IDS = 64;
const RESERVE_IDS = "SELECT nextval(pg_get_serial_sequence('payments', 'id')) FROM generate_series(1, $1::int8)";

/** Bound on opening a connection and on waiting for a free one (as the Rust example's POOL_TIMEOUT). */
const POOL_TIMEOUT_MS = 5000;

/**
 * @typedef {{ id: number, amount: number, currency: string, recipient: string, created_at: string }} Payment
 */

/**
 * A pool of up to `max` connections, in node-postgres' pipeline mode: a query is sent without waiting for the one
 * before it to answer (each still its own Sync), so a transaction's statements and its COMMIT need not wait for
 * each other (the fenced payment itself is one statement: Fence.commitEffect).
 * @param {string} databaseUrl
 * @param {number} max
 */
export function pool(databaseUrl, max) {
  const p = new pg.Pool({ connectionString: databaseUrl, max, connectionTimeoutMillis: POOL_TIMEOUT_MS, keepAlive: true, pipeline: true });
  // An idle connection that breaks is dropped by the pool; the next checkout opens another.
  p.on("error", () => undefined);
  return p;
}

/**
 * Creates idempotency_keys (the writer's migrations not yet recorded, in one transaction under the writer's
 * lock, recorded in idem_writer_migrations as the writer records them), then payments and processor_charges;
 * safe to run concurrently with other instances and writers.
 * @param {pg.Pool} p
 */
export async function migrate(p) {
  const client = await p.connect();
  try {
    await client.query("BEGIN");
    await client.query("SELECT pg_advisory_xact_lock($1)", [WRITER_MIGRATION_LOCK]);
    await client.query(`CREATE TABLE IF NOT EXISTS idem_writer_migrations (
             version    INT         PRIMARY KEY,
             name       TEXT        NOT NULL,
             applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
         )`);
    const applied = new Set((await client.query("SELECT version FROM idem_writer_migrations")).rows.map((r) => r.version));
    for (const file of readdirSync(WRITER_MIGRATIONS).sort()) {
      const m = /^(\d{4})_([a-z0-9_]+)\.sql$/.exec(file);
      // The partitioned variant of 0001 is the writer's choice for a fresh database; the default layout here.
      if (m === null || m[2].endsWith("_partitioned")) continue;
      const version = Number(m[1]);
      if (applied.has(version)) continue;
      await client.query(readFileSync(WRITER_MIGRATIONS + file, "utf8"));
      await client.query("INSERT INTO idem_writer_migrations (version, name) VALUES ($1, $2)", [version, m[2]]);
    }
    await client.query("COMMIT");
    await client.query("BEGIN");
    await client.query("SELECT pg_advisory_xact_lock($1)", [MIGRATION_LOCK]);
    await client.query(CREATE_PAYMENTS);
    await client.query(CREATE_CHARGES);
    await client.query("COMMIT");
  } catch (err) {
    await client.query("ROLLBACK").catch(() => undefined);
    throw err;
  } finally {
    client.release();
  }
}

/**
 * @param {Record<string, unknown>} row
 * @returns {Payment}
 */
function payment(row) {
  return {
    id: Number(row.id),
    amount: Number(row.amount),
    currency: String(row.currency),
    recipient: String(row.recipient),
    created_at: String(row.created_at),
  };
}

/**
 * Inserts a payment on `conn` (the unfenced path: its id and time from Postgres).
 * @param {pg.Pool | pg.PoolClient} conn
 * @param {number} amount
 * @param {string} currency
 * @param {string} recipient
 */
export async function insertPayment(conn, amount, currency, recipient) {
  const { rows } = await conn.query({ name: "insert_payment", text: INSERT, values: [amount, currency, recipient] });
  return payment(rows[0]);
}

/**
 * Payment ids reserved ahead from the table's own sequence, RESERVED_IDS per round trip, so that a fenced payment's
 * response (its id) is known before its row is written (examples/payments-api/src/db.rs PaymentIds). Ids are unique
 * with every other writer of the table (each is a nextval); ids reserved by a process that stops are never used
 * (gaps, as a rolled-back insert leaves). Kept as Postgres answers a BIGINT: decimal text.
 */
export class PaymentIds {
  /** @type {string[]} */
  #ready = [];
  /** The one reservation under way, which the others wait for. @type {Promise<void> | null} */
  #reserving = null;

  /**
   * The next reserved id, reserving more when none is left.
   * @param {pg.Pool} p
   * @returns {Promise<string>}
   */
  async next(p) {
    for (;;) {
      const id = this.#ready.shift();
      if (id !== undefined) return id;
      this.#reserving ??= this.#reserve(p).finally(() => {
        this.#reserving = null;
      });
      await this.#reserving;
    }
  }

  /** @param {pg.Pool} p */
  async #reserve(p) {
    const { rows } = await p.query({ name: "reserve_payment_ids", text: RESERVE_IDS, values: [RESERVED_IDS], rowMode: "array" });
    for (const [id] of rows) this.#ready.push(String(id));
  }
}

/**
 * A fenced payment before it is written: the payment (its response) and the effect's parameters ($7 to $11 of
 * INSERT_FENCED). `created_at` is now on the application's clock (JavaScript's: milliseconds, so within the six
 * fractional digits Postgres keeps the last three are 0), inserted as that timestamptz and formatted as CREATED_AT
 * formats it, so that GET answers the same bytes.
 * @param {string} id A reserved id (PaymentIds)
 * @param {number} amount
 * @param {string} currency
 * @param {string} recipient
 * @param {Date} [now]
 * @returns {{ payment: Payment, row: unknown[] }}
 */
export function newPayment(id, amount, currency, recipient, now = new Date()) {
  const createdAt = rfc3339Micros(now);
  return { payment: { id: Number(id), amount, currency, recipient, created_at: createdAt }, row: [id, amount, currency, recipient, createdAt] };
}

/**
 * `at` as Postgres' CREATED_AT formats it: RFC 3339 UTC, six fractional digits, `Z`.
 * @param {Date} at
 */
export function rfc3339Micros(at) {
  const iso = at.toISOString(); // YYYY-MM-DDTHH:MM:SS.mmmZ
  if (!/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/.test(iso)) throw new RangeError(`a payment's time must have a four-digit year, not ${iso}`);
  return `${iso.slice(0, -1)}000Z`;
}

/**
 * @param {pg.Pool} p
 * @param {bigint} id
 * @returns {Promise<Payment | null>}
 */
export async function findPayment(p, id) {
  const { rows } = await p.query({ name: "find_payment", text: FIND, values: [id.toString()] });
  return rows.length === 0 ? null : payment(rows[0]);
}
