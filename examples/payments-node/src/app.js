// @ts-check
// The Fastify app: POST /payments and GET /payments/{id} behind the
// idempotency plugin (keys scoped by the account a bearer token
// authenticates, read-through from the mirror when asked), the handlers
// seeing the raw request bytes as the Rust example's do; other methods on
// these paths are 405 with Allow, as axum answers. A request without a
// known bearer token is 401 in an onRequest hook, before the plugin runs.
import Fastify from "fastify";
import { idempotencyPlugin } from "idem-client/fastify";
import { createPayment, getPayment } from "./payments.js";

const ACCOUNT = Symbol("payments.account");
const UNAUTHORIZED = { error: "unauthorized", message: "send Authorization: Bearer <token> with a known token" };

/**
 * The account of an Authorization header's value.
 * @param {Map<string, string>} tokens
 * @param {string | undefined} authorization
 * @returns {string | undefined}
 */
export function accountOf(tokens, authorization) {
  if (authorization === undefined || !authorization.startsWith("Bearer ")) return undefined;
  return tokens.get(authorization.slice(7).trim());
}
const METHODS = /** @type {const} */ (["DELETE", "GET", "HEAD", "PATCH", "POST", "PUT", "OPTIONS"]);

/**
 * @param {import("./payments.js").State} state
 * @param {import("idem-client").IdempotencyOptions} idempotency
 * @param {Map<string, string>} tokens bearer tokens and their accounts
 */
export async function buildApp(state, idempotency, tokens) {
  const app = Fastify({ logger: false, bodyLimit: 16 * 1024 * 1024 });
  app.removeAllContentTypeParsers();
  app.addContentTypeParser("*", { parseAs: "buffer" }, (_request, body, done) => done(null, body));
  // Authentication: the account scopes idempotency keys; the client never names it.
  app.addHook("onRequest", async (request, reply) => {
    const account = accountOf(tokens, request.headers.authorization);
    if (account === undefined) return reply.code(401).header("www-authenticate", "Bearer").send(UNAUTHORIZED);
    /** @type {Record<symbol, unknown>} */ (/** @type {unknown} */ (request))[ACCOUNT] = account;
    return undefined;
  });
  /** @param {import("idem-client").HttpRequest} http */
  const tenant = (http) => {
    const account = /** @type {Record<symbol, unknown>} */ (http.source)[ACCOUNT];
    return typeof account === "string" ? account : null;
  };
  await app.register(idempotencyPlugin, { tenant, ...idempotency });

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
