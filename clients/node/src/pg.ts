// What the fence and read-through need of node-postgres: a pool or one
// client, told apart by shape (so any copy of `pg` works), and a bounded
// checkout.
import type { Pool, PoolClient, ClientBase } from "pg";
import { PostgresError } from "./errors.js";

export type Source = Pool | ClientBase;

export function isPool(source: Source): source is Pool {
  return typeof (source as Pool).totalCount === "number" && typeof (source as Pool).connect === "function" && !("processID" in source);
}

/** A client from the pool within `ms`; one that arrives later is released at once. */
export async function checkout(pool: Pool, ms: number): Promise<PoolClient> {
  const pending = pool.connect();
  let timer: NodeJS.Timeout | undefined;
  let timedOut = false;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => {
      timedOut = true;
      reject(new PostgresError(`no Postgres connection within ${ms} ms`));
    }, ms);
  });
  pending.then(
    (client) => {
      if (timedOut) client.release();
    },
    () => undefined,
  );
  try {
    return await Promise.race([pending, timeout]);
  } catch (err) {
    throw err instanceof PostgresError ? err : new PostgresError(describe(err), { cause: err });
  } finally {
    clearTimeout(timer);
  }
}

export function describe(err: unknown): string {
  return err instanceof Error ? err.message || err.name : String(err);
}

/** The SQLSTATE of a node-postgres error, if any. */
export function sqlstate(err: unknown): string | undefined {
  const code = (err as { code?: unknown } | null)?.code;
  return typeof code === "string" ? code : undefined;
}
