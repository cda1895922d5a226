// The Fastify plugin (`idem-client/fastify`): the Idempotency-Key flow of
// ./middleware.ts for Fastify 4 and 5. The key is decided before the body is
// parsed (a preParsing hook reads the raw body, up to maxRequestBody, and
// hands the parser the same bytes), so a parse error is the handler's answer
// as in the Rust layer; the handler finds `request.idempotency` (key, token,
// fence); the response is settled in an onSend hook before it goes out: a
// stream payload is read into memory up to maxResponseBody and answered as
// a Buffer (past that, sent as it comes, not stored). Register encoders such
// as @fastify/compress after the plugin: Fastify runs onSend hooks in the
// order they were added, and the stored body must be the one replays send
// (replays go out without content-encoding).
import { Readable } from "node:stream";
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import { headerPairs, readBody, sendRaw } from "./http.js";
import { Idempotency, problem, type HttpRequest, type HttpResponse, type IdempotencyContext, type IdempotencyOptions, type Run } from "./middleware.js";

declare module "fastify" {
  interface FastifyRequest {
    /** Set for a request the plugin runs under its key: the key, its token and the request's fence. */
    idempotency: IdempotencyContext | null;
    /** The request body's bytes, for a request with an Idempotency-Key. */
    rawBody: Buffer | null;
  }
}

const RUN = Symbol("idem.run");
type WithRun = FastifyRequest & { [RUN]?: Run | undefined };

/** `await app.register(idempotencyPlugin, { client })`; wrapped with Symbol.for("skip-override") so it covers the app's routes. */
export function idempotencyPlugin(fastify: FastifyInstance, options: IdempotencyOptions | { flow: Idempotency }, done: (err?: Error) => void): void {
  if (fastify.hasPlugin("@fastify/compress")) {
    done(new Error("idem-client/fastify: register @fastify/compress after idempotencyPlugin (its onSend hook would run first: the stored body would be the compressed bytes, replayed without their content-encoding)"));
    return;
  }
  const flow = "flow" in options ? options.flow : new Idempotency(options);
  fastify.decorateRequest("idempotency", null);
  fastify.decorateRequest("rawBody", null);

  fastify.addHook("preParsing", async (request: FastifyRequest, reply: FastifyReply, payload: Readable) => {
    const method = request.method.toUpperCase();
    if (!flow.covers(method)) return payload;
    const http: HttpRequest = { method, target: request.raw.url ?? "/", headers: headerPairs(request.raw.rawHeaders), body: Buffer.alloc(0), source: request };
    let key: string | null = "invalid";
    try {
      key = flow.keyOf(http);
    } catch {
      // start() answers the 400.
    }
    if (key === null && !flow.required) return payload;
    if (key !== null) {
      const read = await readBody(payload, flow.maxRequestBody);
      if (read.kind !== "body") return answer(reply, problem(read.kind === "too_large" ? "request_too_large" : "unreadable_request"));
      http.body = read.body;
      request.rawBody = read.body;
    }
    const start = await flow.start(http);
    if (start.kind === "respond") return answer(reply, start.response);
    if (start.kind === "run") {
      (request as WithRun)[RUN] = start.run;
      request.idempotency = start.run.context;
    }
    const replayed = Readable.from(http.body.length > 0 ? [http.body] : []);
    (replayed as Readable & { receivedEncodedLength?: number }).receivedEncodedLength = http.body.length;
    return replayed;
  });

  fastify.addHook("onSend", async (request: FastifyRequest, reply: FastifyReply, payload: unknown) => {
    const run = (request as WithRun)[RUN];
    if (run === undefined) return payload;
    (request as WithRun)[RUN] = undefined;
    let body = toBuffer(payload);
    if (body === null) {
      // A stream (the handler's, or an earlier onSend hook's): read it up to the limit.
      let read: Collected;
      try {
        read = await collect(payload as Readable, flow.maxResponseBody);
      } catch (err) {
        await run.failed(); // the stream failed: no response to store
        throw err;
      }
      if (read.kind === "over") {
        const instead = await run.overflowed();
        if (instead === null) return read.rest;
        read.rest.destroy();
        return replace(reply, instead);
      }
      body = read.body;
      payload = body; // the stream is spent: the bytes go out
    }
    if (body.length > flow.maxResponseBody) {
      const instead = await run.overflowed();
      return instead === null ? payload : replace(reply, instead);
    }
    const response: HttpResponse = { status: reply.statusCode, headers: replyHeaders(reply), body };
    const answer = await run.finish(response);
    return answer === response ? payload : replace(reply, answer);
  });

  // A request whose handler never produced a response (the reply was hijacked) still settles its key.
  fastify.addHook("onResponse", async (request: FastifyRequest) => {
    const run = (request as WithRun)[RUN];
    if (run !== undefined) {
      (request as WithRun)[RUN] = undefined;
      await run.failed();
    }
  });
  done();
}
(idempotencyPlugin as unknown as Record<symbol, boolean>)[Symbol.for("skip-override")] = true;

/** Answers from a hook: the reply is hijacked and written directly (no other hook sees it). */
function answer(reply: FastifyReply, response: HttpResponse): FastifyReply {
  reply.hijack();
  sendRaw(reply.raw, response);
  return reply;
}

/** The reply becomes `answer` (the key's, not the handler's): its status and headers, and its body as the payload. */
function replace(reply: FastifyReply, answer: HttpResponse): Buffer {
  for (const name of Object.keys(reply.getHeaders())) reply.removeHeader(name);
  reply.code(answer.status);
  for (const [name, value] of answer.headers) reply.header(name, typeof value === "string" ? value : value.toString("latin1"));
  return answer.body;
}

function toBuffer(payload: unknown): Buffer | null {
  if (payload === null || payload === undefined) return Buffer.alloc(0);
  if (typeof payload === "string") return Buffer.from(payload, "utf8");
  if (Buffer.isBuffer(payload)) return payload;
  if (payload instanceof Uint8Array) return Buffer.from(payload);
  return null; // a stream
}

type Collected = { kind: "whole"; body: Buffer } | { kind: "over"; rest: Readable };

/**
 * Reads `stream` to its end if it holds at most `limit` bytes; past that, stops reading and answers a stream of
 * what was read followed by the rest, unread yet (sent as it comes, as the Rust layer does).
 */
function collect(stream: Readable, limit: number): Promise<Collected> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    const off = (): void => {
      stream.off("data", onData);
      stream.off("end", onEnd);
      stream.off("error", onError);
    };
    const onData = (chunk: unknown): void => {
      const b = typeof chunk === "string" ? Buffer.from(chunk, "utf8") : chunk instanceof Uint8Array ? Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength) : null;
      if (b === null) {
        off();
        stream.destroy();
        reject(new TypeError("idem-client/fastify: a response stream must yield strings or bytes"));
        return;
      }
      chunks.push(b);
      size += b.length;
      if (size > limit) {
        stream.pause();
        off();
        stream.on("error", () => undefined); // until the rest is read: the reader then sees any error itself
        resolve({ kind: "over", rest: Readable.from(prefixThenRest(Buffer.concat(chunks, size), stream)) });
      }
    };
    const onEnd = (): void => {
      off();
      resolve({ kind: "whole", body: Buffer.concat(chunks, size) });
    };
    const onError = (err: Error): void => {
      off();
      reject(err);
    };
    stream.on("data", onData);
    stream.once("end", onEnd);
    stream.once("error", onError);
  });
}

async function* prefixThenRest(prefix: Buffer, rest: Readable): AsyncGenerator<Buffer> {
  yield prefix;
  for await (const chunk of rest) yield typeof chunk === "string" ? Buffer.from(chunk, "utf8") : (chunk as Buffer);
}

function replyHeaders(reply: FastifyReply): [string, string][] {
  const out: [string, string][] = [];
  for (const [name, value] of Object.entries(reply.getHeaders())) {
    if (value === undefined) continue;
    for (const v of Array.isArray(value) ? value : [value]) out.push([name, String(v)]);
  }
  return out;
}
