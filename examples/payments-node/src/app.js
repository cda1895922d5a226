// @ts-check
// The Fastify app: POST /payments and GET /payments/{id} behind the
// idempotency plugin (keys scoped by X-Account-Id, read-through from the
// mirror when asked), the handlers seeing the raw request bytes as the Rust
// example's do; other methods on these paths are 405 with Allow, as axum
// answers.
import Fastify from "fastify";
import { idempotencyPlugin } from "idem-client/fastify";
import { createPayment, getPayment } from "./payments.js";

/** Header that scopes idempotency keys per account. */
export const ACCOUNT_HEADER = "x-account-id";
const METHODS = /** @type {const} */ (["DELETE", "GET", "HEAD", "PATCH", "POST", "PUT", "OPTIONS"]);

/**
 * @param {import("./payments.js").State} state
 * @param {import("idem-client").IdempotencyOptions} idempotency
 */
export async function buildApp(state, idempotency) {
  const app = Fastify({ logger: false, bodyLimit: 16 * 1024 * 1024 });
  app.removeAllContentTypeParsers();
  app.addContentTypeParser("*", { parseAs: "buffer" }, (_request, body, done) => done(null, body));
  await app.register(idempotencyPlugin, { tenantHeader: ACCOUNT_HEADER, ...idempotency });

  /**
   * @param {import("fastify").FastifyReply} reply
   * @param {import("./payments.js").Answer} answer
   */
  const send = (reply, answer) => reply.code(answer.status).headers(answer.headers).send(answer.body);

  app.post("/payments", async (request, reply) => {
    const body = request.rawBody ?? (Buffer.isBuffer(request.body) ? request.body : Buffer.alloc(0));
    return send(reply, await createPayment(state, body, request.idempotency?.fence ?? null));
  });
  app.get("/payments/:id", async (request, reply) => {
    const { id } = /** @type {{ id: string }} */ (request.params);
    return send(reply, await getPayment(state, id));
  });
  const notAllowed = (/** @type {string} */ allow) => async (/** @type {unknown} */ _request, /** @type {import("fastify").FastifyReply} */ reply) =>
    reply.code(405).header("allow", allow).send();
  app.route({ method: METHODS.filter((m) => m !== "POST"), url: "/payments", handler: notAllowed("POST") });
  app.route({ method: METHODS.filter((m) => m !== "GET" && m !== "HEAD"), url: "/payments/:id", handler: notAllowed("GET,HEAD") });
  return app;
}
