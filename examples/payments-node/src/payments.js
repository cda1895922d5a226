// @ts-check
// The HTTP handlers, as examples/payments-api/src/payments.rs: POST /payments
// (validate, charge at the processor, insert one row, 201) and
// GET /payments/{id}. With the fence (the default) in two phases: a durable
// claim of the key, the processor's charge under the fence's downstream key
// with no Postgres connection held, then one autocommitted statement that
// inserts the payment and completes the key's row, only while this request
// still holds it (Fence.commitEffect: the response, its id reserved ahead, is
// known before the row is written).
import { storedResponse } from "idem-client";
import * as db from "./db.js";

/** Longest recipient accepted, in characters. */
const MAX_RECIPIENT_CHARS = 200;
const FIELDS = ["amount", "currency", "recipient"];

/**
 * @typedef {{ status: number, headers: Record<string, string>, body: Buffer }} Answer
 * @typedef {{ amount: number, currency: string, recipient: string }} NewPayment
 * @typedef {{ db: import("pg").Pool, processor: import("./processor.js").Processor, fence: boolean, ids: db.PaymentIds, log: (msg: string) => void }} State
 */

/**
 * @param {number} status
 * @param {string} code
 * @param {string} message
 * @returns {Answer}
 */
export function error(status, code, message) {
  return { status, headers: { "content-type": "application/json" }, body: Buffer.from(JSON.stringify({ error: code, message })) };
}

/**
 * The request's payment, or why it is not one: 400 for a body that is not JSON, 422 for JSON that is not a payment.
 * @param {Buffer} body
 * @returns {NewPayment | Answer}
 */
export function parse(body) {
  let value;
  try {
    value = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(body));
  } catch (err) {
    return error(400, "invalid_json", err instanceof Error ? err.message : String(err));
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    return error(422, "invalid_payment", "invalid type: expected struct NewPayment");
  }
  for (const name of Object.keys(value)) {
    if (!FIELDS.includes(name)) return error(422, "invalid_payment", `unknown field \`${name}\`, expected one of \`amount\`, \`currency\`, \`recipient\``);
  }
  for (const name of FIELDS) if (!(name in value)) return error(422, "invalid_payment", `missing field \`${name}\``);
  const { amount, currency, recipient } = value;
  // A payment's amount is a 64-bit integer in Rust; JSON numbers here are doubles, so beyond 2^53 is refused.
  if (typeof amount !== "number" || !Number.isSafeInteger(amount)) return error(422, "invalid_payment", "invalid type: amount, expected i64");
  if (typeof currency !== "string") return error(422, "invalid_payment", "invalid type: currency, expected a string");
  if (typeof recipient !== "string") return error(422, "invalid_payment", "invalid type: recipient, expected a string");
  const violation = violationOf(amount, currency, recipient);
  if (violation !== null) return error(422, "invalid_payment", violation);
  return { amount, currency, recipient };
}

/**
 * The first rule the request breaks, if any.
 * @param {number} amount
 * @param {string} currency
 * @param {string} recipient
 */
export function violationOf(amount, currency, recipient) {
  if (amount <= 0) return "amount must be a positive integer (minor units)";
  if (!/^[A-Z]{3}$/.test(currency)) return "currency must be a three-letter ISO 4217 code such as EUR";
  const trimmed = trimRust(recipient);
  if (trimmed.length === 0 || [...trimmed].length > MAX_RECIPIENT_CHARS) return "recipient must be 1 to 200 characters";
  return null;
}

/**
 * Rust's str::trim: Unicode White_Space at both ends (JavaScript's trim also takes U+FEFF, which Rust keeps).
 * @param {string} s
 */
function trimRust(s) {
  return s.replace(/^[\p{White_Space}]+|[\p{White_Space}]+$/gu, "");
}

/**
 * POST /payments.
 * @param {State} state
 * @param {Buffer} body
 * @param {import("idem-client").Fence | null} fence The request's fence (null without an Idempotency-Key)
 * @returns {Promise<Answer>}
 */
export async function createPayment(state, body, fence) {
  const request = parse(body);
  if ("status" in request) return request;
  const recipient = trimRust(request.recipient);
  return fence !== null && state.fence ? createFenced(state, fence, request, recipient) : createUnfenced(state, request, recipient);
}

/**
 * Claim, charge, then the payment and its idempotency row in one autocommitted statement (the response, its id
 * reserved ahead, is known before the row is written). A failure after the claim leaves it to the middleware to
 * release (the claim was made through the pool); the retry's charge under the same downstream key finds the first
 * one.
 * @param {State} state
 * @param {import("idem-client").Fence} fence
 * @param {NewPayment} request
 * @param {string} recipient
 * @returns {Promise<Answer>}
 */
async function createFenced(state, fence, request, recipient) {
  try {
    const claim = await fence.claim(state.db);
    if (claim.kind !== "proceed") return claimAnswer(claim);
    await state.processor.charge(fence.downstreamKey(), request.amount, request.currency);
    const id = await state.ids.next(state.db);
    const { payment, row } = db.newPayment(id, request.amount, request.currency, recipient);
    const created = createdResponse(payment);
    const done = await fence.commitEffect(state.db, created, db.INSERT_FENCED, row);
    // Another holder took the key over meanwhile: nothing was committed; the middleware answers what the key holds.
    return done.kind === "committed" ? answer(created) : claimAnswer(done.claim);
  } catch (err) {
    state.log(`fenced payment: ${String(err)}`);
    return error(500, "internal", "the payment could not be stored");
  }
}

/**
 * Without the fence there is no downstream key: every run charges.
 * @param {State} state
 * @param {NewPayment} request
 * @param {string} recipient
 * @returns {Promise<Answer>}
 */
async function createUnfenced(state, request, recipient) {
  try {
    await state.processor.charge(null, request.amount, request.currency);
  } catch (err) {
    state.log(`processor: ${String(err)}`);
    return error(500, "internal", "the payment could not be charged");
  }
  try {
    return answer(createdResponse(await db.insertPayment(state.db, request.amount, request.currency, recipient)));
  } catch (err) {
    state.log(`insert payment: ${String(err)}`);
    return error(500, "internal", "the payment could not be stored");
  }
}

/**
 * The 201 for a new payment, as stored and as sent.
 * @param {db.Payment} payment
 */
function createdResponse(payment) {
  return storedResponse(201, JSON.stringify(payment), [
    ["content-type", "application/json"],
    ["location", `/payments/${payment.id}`],
  ]);
}

/**
 * @param {import("idem-client").StoredResponse} stored
 * @returns {Answer}
 */
function answer(stored) {
  /** @type {Record<string, string>} */
  const headers = {};
  for (const [name, value] of stored.headers) headers[name] = value.toString("latin1");
  return { status: stored.status, headers, body: stored.body };
}

/**
 * What the handler answers when the claim did not proceed (the middleware gives the same answers; without it these stand).
 * @param {import("idem-client").Claim} claim
 * @returns {Answer}
 */
function claimAnswer(claim) {
  if (claim.kind === "replay") {
    const a = answer(claim.response);
    a.headers["idempotent-replayed"] = "true";
    return a;
  }
  if (claim.kind === "mismatch") return error(422, "idempotency_key_reused", "the key was used for another request");
  return error(409, "idempotency_key_in_use", "a request with this key is being processed");
}

/**
 * GET /payments/{id}: 400 for an id that is not a 64-bit integer.
 * @param {State} state
 * @param {string} id
 * @returns {Promise<Answer>}
 */
export async function getPayment(state, id) {
  const n = /^[+-]?[0-9]+$/.test(id) ? BigInt(id) : null;
  if (n === null || n > (1n << 63n) - 1n || n < -(1n << 63n)) {
    return { status: 400, headers: { "content-type": "text/plain; charset=utf-8" }, body: Buffer.from(`Invalid URL: Cannot parse \`${id}\` to a \`i64\``) };
  }
  try {
    const payment = await db.findPayment(state.db, n);
    if (payment === null) return error(404, "not_found", "no payment with this id");
    return { status: 200, headers: { "content-type": "application/json" }, body: Buffer.from(JSON.stringify(payment)) };
  } catch (err) {
    state.log(`read payment: ${String(err)}`);
    return error(500, "internal", "the payment could not be read");
  }
}
