// @ts-check
// The payment processor the API calls, simulated as in
// examples/payments-api/src/processor.rs: it takes PROCESSOR_DELAY_MS to
// answer and honours an Idempotency-Key as Stripe's and Adyen's APIs do (a
// second call with the same key returns the first call's charge and charges
// nothing). Its ledger, processor_charges, stands for the processor's own
// records; its connection is held for one statement only, never across the
// latency.
import { randomUUID } from "node:crypto";

/** Records the charge under the key unless the key has one, answering the new charge's id. */
const CHARGE =
  "INSERT INTO processor_charges (idempotency_key, amount, currency) VALUES ($1, $2, $3) ON CONFLICT (idempotency_key) DO NOTHING RETURNING id";
/** The key's charge, read in a statement of its own: one a concurrent call committed while CHARGE waited is not in CHARGE's snapshot. */
const EXISTING = "SELECT id FROM processor_charges WHERE idempotency_key = $1";

export class Processor {
  /**
   * @param {import("pg").Pool} ledger
   * @param {number} delayMs
   */
  constructor(ledger, delayMs) {
    this.ledger = ledger;
    this.delayMs = delayMs;
  }

  /**
   * Charges `amount` under `idempotencyKey` (a fresh key when null: every such call charges) and answers the
   * charge id after the processor's latency.
   * @param {string | null} idempotencyKey
   * @param {number} amount
   * @param {string} currency
   * @returns {Promise<number>}
   */
  async charge(idempotencyKey, amount, currency) {
    const key = idempotencyKey ?? `anon-${process.pid}-${randomUUID()}`;
    const charged = await this.ledger.query({ name: "charge", text: CHARGE, values: [key, amount, currency] });
    const id = charged.rows.length > 0 ? charged.rows[0].id : (await this.ledger.query({ name: "existing_charge", text: EXISTING, values: [key] })).rows[0].id;
    if (this.delayMs > 0) await new Promise((resolve) => setTimeout(resolve, this.delayMs));
    return Number(id);
  }
}
