// The Express middleware (`idem-client/express`): the Idempotency-Key flow of
// ./middleware.ts for Express 4 and 5. It reads the request body itself (up
// to maxRequestBody; `req.rawBody` holds the bytes, and `req.body` the parsed
// JSON when the content type is JSON, so body parsers after it do not read
// again; JSON that does not parse is express.json()'s 400 error), hands the handler `req.idempotency` (key, token, fence), buffers
// the response (up to maxResponseBody) and sends it once the key is settled.
import type { IncomingMessage, ServerResponse } from "node:http";
import { isJsonContentType } from "./fingerprint.js";
import { headerPairs, readBody, sendRaw } from "./http.js";
import { Idempotency, problem, type HttpRequest, type HttpResponse, type IdempotencyContext, type IdempotencyOptions, type Run } from "./middleware.js";

/** What the middleware adds to a request it covers. */
export interface IdempotentRequest extends IncomingMessage {
  rawBody?: Buffer;
  body?: unknown;
  originalUrl?: string;
  idempotency?: IdempotencyContext;
}

type Next = (err?: unknown) => void;
export type ExpressMiddleware = ((req: IncomingMessage, res: ServerResponse, next: Next) => void) & { flow: Idempotency };

/** `app.use(idempotency({ client }))`, or `app.post("/payments", idempotency(...), handler)`. */
export function idempotency(options: IdempotencyOptions | Idempotency): ExpressMiddleware {
  const flow = options instanceof Idempotency ? options : new Idempotency(options);
  const middleware = (req: IncomingMessage, res: ServerResponse, next: Next): void => {
    handle(flow, req as IdempotentRequest, res, next).catch(next);
  };
  return Object.assign(middleware, { flow });
}

async function handle(flow: Idempotency, req: IdempotentRequest, res: ServerResponse, next: Next): Promise<void> {
  const method = (req.method ?? "GET").toUpperCase();
  if (!flow.covers(method)) {
    next();
    return;
  }
  const request: HttpRequest = { method, target: req.originalUrl ?? req.url ?? "/", headers: headerPairs(req.rawHeaders), body: Buffer.alloc(0), source: req };
  let key: string | null = "invalid";
  try {
    key = flow.keyOf(request);
  } catch {
    // start() answers the 400.
  }
  if (key === null && !flow.required) {
    next();
    return;
  }
  // A JSON body that does not parse: the error express.json() gives (400), passed on once the key is held, so
  // the app's error handler answers it and that answer is stored, as a parse error is the handler's answer on
  // Fastify and in the Rust layer (a body parser after the middleware finds the body read and does nothing).
  let parseError: Error | null = null;
  if (key !== null) {
    if (req.readableEnded) {
      // A body parser ran first: the bytes the fingerprint needs are gone.
      next(new Error("idem-client/express: the request body was already read; mount the idempotency middleware before body parsers"));
      return;
    }
    const read = await readBody(req, flow.maxRequestBody);
    if (read.kind !== "body") {
      sendRaw(res, problem(read.kind === "too_large" ? "request_too_large" : "unreadable_request"));
      return;
    }
    request.body = read.body;
    req.rawBody = read.body;
    const contentType = lines(request, "content-type")[0];
    if (contentType !== undefined && isJsonContentType(contentType) && read.body.length > 0) {
      try {
        req.body = JSON.parse(read.body.toString("utf8")) as unknown;
      } catch (err) {
        parseError = badJson(err, read.body);
      }
    }
  }
  const start = await flow.start(request);
  if (start.kind === "pass") {
    next(parseError ?? undefined);
    return;
  }
  if (start.kind === "respond") {
    sendRaw(res, start.response);
    return;
  }
  req.idempotency = start.run.context;
  capture(res, start.run, flow.maxResponseBody);
  next(parseError ?? undefined);
}

/** A JSON syntax error shaped as body-parser's (express.json()): status 400, type "entity.parse.failed". */
function badJson(err: unknown, body: Buffer): Error {
  const message = err instanceof Error ? err.message : String(err);
  return Object.assign(new SyntaxError(message), { status: 400, statusCode: 400, expose: true, type: "entity.parse.failed", body: body.toString("utf8") });
}

function lines(request: HttpRequest, name: string): Buffer[] {
  return request.headers.filter(([n]) => n === name).map(([, v]) => v);
}

type Chunk = string | Uint8Array;

/** Buffers what the handler writes; at its end, settles the key and sends what the client gets. */
function capture(res: ServerResponse, run: Run, limit: number): void {
  // eslint-disable-next-line @typescript-eslint/unbound-method -- put back on `res` as they were
  const original = { writeHead: res.writeHead, write: res.write, end: res.end };
  const rawWrite = original.write as (this: ServerResponse, chunk: Buffer) => boolean;
  const rawEnd = original.end as (this: ServerResponse, chunk?: Buffer | (() => void), cb?: () => void) => ServerResponse;
  const chunks: Buffer[] = [];
  let size = 0;
  let passing = false;
  let ended = false;
  const restore = (): void => {
    res.writeHead = original.writeHead;
    res.write = original.write;
    res.end = original.end;
  };
  const toBuffer = (chunk: Chunk, encoding?: BufferEncoding): Buffer => (typeof chunk === "string" ? Buffer.from(chunk, encoding ?? "utf8") : Buffer.from(chunk));
  const add = (chunk: Chunk | undefined, encoding?: BufferEncoding): void => {
    if (chunk === undefined) return;
    const b = toBuffer(chunk, encoding);
    chunks.push(b);
    size += b.length;
  };
  // Past the limit, what the handler writes is held until the key is settled: then sent as it comes, or, when
  // the fence's answer stands instead (the handler's effect rolled back), that answer and nothing of the handler's.
  let holding = false;
  let endCallback: (() => void) | undefined;
  const overflow = (): void => {
    passing = true;
    holding = true;
    const settled = (instead: HttpResponse | null): void => {
      holding = false;
      restore();
      if (instead !== null) {
        sendRaw(res, instead);
        res.write = (() => true) as typeof res.write; // the rest of the handler's response is dropped
        res.end = (() => res) as typeof res.end;
        if (ended) endCallback?.();
        return;
      }
      rawWrite.call(res, Buffer.concat(chunks));
      if (ended) rawEnd.call(res, endCallback);
    };
    run.overflowed().then(settled, () => {
      settled(problem("internal"));
    });
  };
  res.writeHead = function (status: number, ...rest: unknown[]): ServerResponse {
    res.statusCode = status;
    const headers = rest.find((r) => typeof r === "object" && r !== null);
    if (Array.isArray(headers)) {
      for (let i = 0; i + 1 < headers.length; i += 2) res.appendHeader(String(headers[i]), String(headers[i + 1]));
    } else if (headers !== undefined) {
      for (const [name, value] of Object.entries(headers as Record<string, string | string[] | number>)) res.setHeader(name, value);
    }
    return res;
  };
  res.write = function (chunk: Chunk, encoding?: unknown, cb?: unknown): boolean {
    add(chunk, typeof encoding === "string" ? (encoding as BufferEncoding) : undefined);
    if (size > limit && !passing) overflow();
    const callback = typeof encoding === "function" ? encoding : cb;
    if (typeof callback === "function") process.nextTick(() => { (callback as () => void)(); });
    return true;
  } as typeof res.write;
  res.end = function (chunk?: unknown, encoding?: unknown, cb?: unknown): ServerResponse {
    if (ended) return res;
    ended = true;
    if (typeof chunk === "function") cb = chunk;
    else if (chunk !== undefined && chunk !== null) add(chunk as Chunk, typeof encoding === "string" ? (encoding as BufferEncoding) : undefined);
    const callback = (typeof encoding === "function" ? encoding : cb) as (() => void) | undefined;
    if (passing || size > limit) {
      if (!passing) overflow();
      if (holding) {
        endCallback = callback; // ended once the key is settled
        return res;
      }
      restore();
      return rawEnd.call(res, callback);
    }
    restore();
    const response: HttpResponse = { status: res.statusCode, headers: responseHeaders(res), body: Buffer.concat(chunks) };
    void run.finish(response).then(
      (answer) => {
        if (answer !== response) sendRaw(res, answer);
        else {
          res.setHeader("content-length", response.body.length);
          rawEnd.call(res, response.body, callback);
        }
      },
      () => sendRaw(res, problem("internal")),
    );
    return res;
  } as typeof res.end;
  // A client hanging up does not cut the flow short: the handler's end still settles the key.
}

function responseHeaders(res: ServerResponse): [string, string][] {
  const out: [string, string][] = [];
  for (const [name, value] of Object.entries(res.getHeaders())) {
    if (value === undefined) continue;
    for (const v of Array.isArray(value) ? value : [value]) out.push([name, String(v)]);
  }
  return out;
}
