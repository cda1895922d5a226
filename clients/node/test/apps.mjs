// The same test application on Express (the middleware) and Fastify (the
// plugin), so every HTTP scenario runs against both adapters, plus a small
// HTTP client that sends header lines exactly as given.
import http from "node:http";
import { Readable } from "node:stream";
import express from "express";
import Fastify from "fastify";
import { idempotency } from "../dist/express.js";
import { idempotencyPlugin } from "../dist/fastify.js";
import { freePort, sleep } from "./helpers.mjs";

/** Calls per route and key header, for "did the handler run again". */
export class Calls {
  constructor() {
    this.counts = new Map();
  }
  hit(name) {
    const n = (this.counts.get(name) ?? 0) + 1;
    this.counts.set(name, n);
    return n;
  }
  of(name) {
    return this.counts.get(name) ?? 0;
  }
}

/** The routes, framework-neutral: (ctx) => {status, headers, body} or a throw. */
function routes(calls, extra) {
  return {
    "/echo": async (ctx) => {
      const n = calls.hit(`echo:${ctx.key}`);
      return {
        status: 201,
        headers: { "content-type": "application/json", location: `/things/${n}`, "x-not-stored": "yes" },
        body: JSON.stringify({ n, body: ctx.body.toString("utf8") }),
      };
    },
    "/status": async (ctx) => {
      calls.hit(`status:${ctx.key}`);
      return { status: Number(ctx.query.get("code")), headers: { "content-type": "text/plain" }, body: "status" };
    },
    "/slow": async (ctx) => {
      const n = calls.hit(`slow:${ctx.key}`);
      await sleep(Number(ctx.query.get("ms")));
      return { status: 201, headers: { "content-type": "text/plain" }, body: `slow ${n}` };
    },
    "/boom": async (ctx) => {
      calls.hit(`boom:${ctx.key}`);
      throw new Error("the handler failed");
    },
    "/big": async (ctx) => {
      calls.hit(`big:${ctx.key}`);
      return { status: 200, headers: { "content-type": "text/plain" }, body: "x".repeat(Number(ctx.query.get("size"))) };
    },
    "/stream": async (ctx) => {
      const n = calls.hit(`stream:${ctx.key}`);
      const body = `${n}:`.padEnd(Number(ctx.query.get("size")), "s");
      return { status: 201, headers: { "content-type": "text/plain", location: `/streams/${n}` }, body, stream: true };
    },
    ...extra(calls),
  };
}

/** `body` as a stream of 1000-byte chunks, each after a turn of the event loop. */
export function streamOf(body) {
  const bytes = Buffer.from(body);
  return Readable.from((async function* () {
    for (let i = 0; i < bytes.length; i += 1000) {
      await new Promise((resolve) => setImmediate(resolve));
      yield bytes.subarray(i, i + 1000);
    }
  })());
}

function ctxOf(path, target, headers, rawBody, idem) {
  const url = new URL(target, "http://x");
  const keyHeader = headers["idempotency-key"];
  return { path, query: url.searchParams, body: rawBody ?? Buffer.alloc(0), key: `${headers["x-account-id"] ?? ""}/${keyHeader ?? "-"}`, idem };
}

/** An Express app with the middleware, listening on a free port; `beforeMiddleware(app)` runs before it is mounted. */
export async function expressApp(options, extra = () => ({}), beforeMiddleware = () => undefined) {
  const calls = new Calls();
  const app = express();
  const mw = idempotency(options);
  beforeMiddleware(app);
  app.use(mw);
  for (const [path, handler] of Object.entries(routes(calls, extra))) {
    app.post(path, async (req, res) => {
      const out = await handler(ctxOf(path, req.originalUrl, req.headers, req.rawBody, req.idempotency));
      res.status(out.status).set(out.headers);
      if (out.stream) streamOf(out.body).pipe(res);
      else res.send(Buffer.from(out.body));
    });
  }
  app.get("/echo", (_req, res) => {
    calls.hit("get");
    res.send("got");
  });
  app.post("/{*any}", (_req, res) => {
    res.status(201).send("any");
  });
  return listen(app, calls, mw.flow);
}

async function listen(handler, calls, flow) {
  const port = await freePort();
  const server = http.createServer(handler);
  await new Promise((resolve) => server.listen(port, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${port}`,
    calls,
    flow,
    async close() {
      server.closeAllConnections();
      await new Promise((resolve) => server.close(resolve));
      await flow.drain();
    },
  };
}

/** A Fastify app with the plugin, listening on a free port; `beforePlugin(app)` runs before the plugin is registered. */
export async function fastifyApp(options, extra = () => ({}), beforePlugin = () => undefined) {
  const calls = new Calls();
  const app = Fastify();
  app.removeAllContentTypeParsers();
  app.addContentTypeParser("*", { parseAs: "buffer" }, (_req, body, done) => done(null, body));
  const { Idempotency } = await import("../dist/index.js");
  const flow = new Idempotency(options);
  beforePlugin(app);
  await app.register(idempotencyPlugin, { flow });
  for (const [path, handler] of Object.entries(routes(calls, extra))) {
    app.post(path, async (request, reply) => {
      const out = await handler(ctxOf(path, request.raw.url, request.headers, request.rawBody ?? request.body, request.idempotency));
      reply.code(out.status).headers(out.headers);
      return out.stream ? streamOf(out.body) : Buffer.from(out.body);
    });
  }
  app.get("/echo", async () => {
    calls.hit("get");
    return "got";
  });
  app.post("/*", async (_request, reply) => {
    reply.code(201);
    return "any";
  });
  const port = await freePort();
  await app.listen({ port, host: "127.0.0.1" });
  return {
    url: `http://127.0.0.1:${port}`,
    calls,
    flow,
    async close() {
      await app.close();
      await flow.drain();
    },
  };
}

export const FRAMEWORKS = { express: expressApp, fastify: fastifyApp };

/** One request; `headers` is a list of [name, value] lines sent in order (a repeated name as repeated lines). */
export function request(base, { method = "POST", path, headers = [], body = "" }) {
  const url = new URL(base);
  const payload = Buffer.isBuffer(body) ? body : Buffer.from(body);
  // A name given more than once goes out as that many header lines.
  const grouped = { "content-length": String(payload.length) };
  for (const [name, value] of headers) grouped[name] = name in grouped ? [grouped[name], value].flat() : value;
  return new Promise((resolve, reject) => {
    const req = http.request({ host: url.hostname, port: url.port, method, path, headers: grouped, agent: false }, (res) => {
      const chunks = [];
      res.on("data", (c) => chunks.push(c));
      res.on("end", () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks), text: Buffer.concat(chunks).toString() }));
      res.on("error", reject);
    });
    req.on("error", reject);
    req.end(payload);
  });
}
