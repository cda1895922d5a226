// The fenced payment's row made before it is written, on a database of its
// own: ids reserved ahead (one reservation at a time, the others waiting;
// unique with the table's other writers; a failed reservation fails its
// waiters and the next call reserves again), and a payment committed through
// Fence.commitEffect reads back through GET's query as the same bytes.
import { test, before } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { Fence } from "idem-client";
import { emptyDatabase } from "../../../clients/node/test/helpers.mjs";
import * as db from "../src/db.js";

let database;
before(async () => {
  database = await emptyDatabase();
  const pool = database.pool(2);
  await db.migrate(pool);
});

/** `pool` with its queries counted. */
function counted(pool) {
  const wrapper = { count: 0, query: (...args) => ((wrapper.count += 1), pool.query(...args)) };
  return wrapper;
}

test("ids are reserved 64 at a time by one caller while the others wait, unique with the table's other writers", async () => {
  const pool = database.pool(4);
  const ids = new db.PaymentIds();
  const source = counted(pool);
  const first = await Promise.all(Array.from({ length: 100 }, () => ids.next(source)));
  assert.equal(source.count, 2, "two reservations for 100 ids");
  assert.equal(new Set(first).size, 100);
  for (const id of first) assert.match(id, /^[1-9][0-9]*$/, "decimal text, as Postgres answers a BIGINT");
  // Another writer (the unfenced insert, the column's default) takes the sequence's next value: not a reserved one.
  const other = await db.insertPayment(pool, 5, "EUR", "other");
  assert.ok(!first.includes(String(other.id)));
  const rest = await Promise.all(Array.from({ length: 28 }, () => ids.next(source)));
  assert.equal(source.count, 2, "the second reservation's last 28");
  const next = await ids.next(source);
  assert.equal(source.count, 3);
  assert.equal(new Set([...first, ...rest, next, String(other.id)]).size, 130);
});

test("a reservation that fails fails the callers waiting for it; the next call reserves again", async () => {
  const ids = new db.PaymentIds();
  const failing = { query: async () => Promise.reject(new Error("no connection")) };
  const answers = await Promise.allSettled([ids.next(failing), ids.next(failing), ids.next(failing)]);
  assert.deepEqual(answers.map((a) => a.status), ["rejected", "rejected", "rejected"]);
  assert.match(await ids.next(database.pool(1)), /^[1-9][0-9]*$/);
});

test("created_at is the application's clock formatted as Postgres formats it", () => {
  assert.equal(db.rfc3339Micros(new Date("2025-12-04T07:08:09.010Z")), "2025-12-04T07:08:09.010000Z");
  assert.equal(db.rfc3339Micros(new Date(Date.UTC(2026, 0, 1))), "2026-01-01T00:00:00.000000Z");
  assert.throws(() => db.rfc3339Micros(new Date(Date.UTC(10000, 0, 1))), RangeError);
});

test("a payment committed through commitEffect reads back through GET's query as the same bytes", async () => {
  const pool = database.pool(2);
  const ids = new db.PaymentIds();
  for (const now of [new Date(), new Date("2025-12-04T23:59:59.999Z"), new Date("2025-03-30T01:30:00.000Z")]) {
    const fence = new Fence(`idem:{t:${randomUUID()}}`, 1n, Buffer.from("fp"), 60_000);
    assert.deepEqual(await fence.claim(pool), { kind: "proceed" });
    const { payment, row } = db.newPayment(await ids.next(pool), 500, "EUR", "alice", now);
    const body = Buffer.from(JSON.stringify(payment));
    const done = await fence.commitEffect(pool, { status: 201, body, headers: [] }, db.INSERT_FENCED, row);
    assert.deepEqual(done, { kind: "committed" });
    const found = await db.findPayment(pool, BigInt(row[0]));
    assert.equal(JSON.stringify(found), body.toString(), "GET's bytes are the POST's");
  }
});
