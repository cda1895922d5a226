// Node HTTP plumbing the Express middleware and the Fastify plugin share:
// header lines as sent, and reading a request body up to a limit.
import type { IncomingMessage, ServerResponse } from "node:http";
import type { Readable } from "node:stream";
import type { HttpResponse } from "./middleware.js";

/** Header lines in request order, names lowercased, values as their bytes (Node keeps them as Latin-1). */
export function headerPairs(rawHeaders: readonly string[]): [string, Buffer][] {
  const out: [string, Buffer][] = [];
  for (let i = 0; i + 1 < rawHeaders.length; i += 2) {
    out.push([(rawHeaders[i] as string).toLowerCase(), Buffer.from(rawHeaders[i + 1] as string, "latin1")]);
  }
  return out;
}

export type BodyRead = { kind: "body"; body: Buffer } | { kind: "too_large" } | { kind: "unreadable" };

/** The whole body, or what went wrong: larger than `limit`, or the stream failed or was cut short. */
export function readBody(stream: Readable | IncomingMessage, limit: number): Promise<BodyRead> {
  return new Promise((resolve) => {
    const chunks: Buffer[] = [];
    let size = 0;
    let done = false;
    const finish = (result: BodyRead): void => {
      if (done) return;
      done = true;
      stream.off("data", onData);
      stream.off("end", onEnd);
      stream.off("error", onError);
      stream.off("aborted", onError);
      stream.off("close", onClose);
      if (result.kind !== "body") stream.resume(); // drain what is left, unread
      resolve(result);
    };
    const onData = (chunk: Buffer | string): void => {
      const b = typeof chunk === "string" ? Buffer.from(chunk) : chunk;
      size += b.length;
      if (size > limit) finish({ kind: "too_large" });
      else chunks.push(b);
    };
    const onEnd = (): void => finish({ kind: "body", body: Buffer.concat(chunks) });
    const onError = (): void => finish({ kind: "unreadable" });
    const onClose = (): void => {
      // A request closed before its end event was cut short.
      setImmediate(() => finish({ kind: "unreadable" }));
    };
    stream.on("data", onData);
    stream.on("end", onEnd);
    stream.on("error", onError);
    stream.on("aborted", onError);
    stream.on("close", onClose);
  });
}

/** Sends `response` on a raw Node response whose head was not written. */
export function sendRaw(res: ServerResponse, response: HttpResponse): void {
  if (res.headersSent || res.writableEnded) return;
  for (const name of res.getHeaderNames()) res.removeHeader(name);
  res.statusCode = response.status;
  for (const [name, value] of response.headers) res.appendHeader(name, typeof value === "string" ? value : value.toString("latin1"));
  res.setHeader("content-length", response.body.length);
  res.end(response.body);
}
