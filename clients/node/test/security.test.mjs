// Secrets and TLS (issue 38): a malformed Redis URL's error does not carry
// the password; against TLS-only redis-servers with a throwaway CA, a
// certificate not trusted, a host name the certificate does not name and a
// missing client certificate each fail at once with TLS' own reason (never
// retried as an outage), and a trusted server with a client certificate
// runs the commands.
import { test, before } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import * as idem from "../dist/index.js";
import { certificates, startTlsRedis, key } from "./helpers.mjs";

const fp = (s) => createHash("sha256").update(s).digest();
let certs;

before(() => {
  certs = certificates();
});

test("a malformed Redis URL is an error naming it with its password masked, nowhere else in the error", async () => {
  for (const url of ["redis://user:s3cret@127.0.0.1:99999/", "redis://:s3cret@[bad/", "http://:s3cret@h/", "rediss://app:s3cret@host:port/"]) {
    const err = await idem.IdemClient.connect(url, { callTimeoutMs: 300 }).then(() => null, (e) => e);
    assert.ok(err instanceof TypeError, `${url}: ${err}`);
    assert.match(err.message, /^invalid Redis URL [a-z]+:\/\/[a-z]*:\*\*\*@/);
    assert.doesNotMatch(JSON.stringify(err, Object.getOwnPropertyNames(err)), /s3cret/);
    assert.equal(err.input, undefined);
    assert.equal(err.cause, undefined);
  }
  assert.equal(idem.maskUrl("redis://u:p@ss@h:1/0"), "redis://u:***@h:1/0");
  assert.equal(idem.maskUrl("rediss://:pw@h"), "rediss://:***@h");
  assert.equal(idem.maskUrl("redis://h:1/?x=a@b"), "redis://h:1/?x=a@b");
});

test("TLS: a trusted server with a client certificate runs the commands; each TLS refusal fails at once with its reason", async () => {
  const server = await startTlsRedis(certs);
  const ok = await idem.IdemClient.connect(server.url, { redis: { socket: server.tls } });
  const k = key();
  assert.equal((await ok.begin(k, fp("a"), { ttlMs: 60_000 })).kind, "new");
  await ok.close();

  const refused = async (socket, pattern, code, url = server.url) => {
    const t0 = Date.now();
    const err = await idem.IdemClient.connect(url, { callTimeoutMs: 2000, redis: { socket } }).then(() => null, (e) => e);
    assert.ok(err instanceof idem.OtherRedisError, String(err));
    assert.equal(err.isUnreachable, false, "fail closed: never run unprotected, never retried as an outage");
    assert.match(err.message, pattern);
    assert.doesNotMatch(err.message, /no answer within/);
    assert.equal(err.cause?.code, code);
    assert.ok(Date.now() - t0 < 1500, `failed after ${Date.now() - t0} ms`);
  };
  // Not trusted: the platform's store does not know the throwaway CA.
  const without = (o, ...names) => Object.fromEntries(Object.entries(o).filter(([n]) => !names.includes(n)));
  const untrusted = without(server.tls, "ca");
  await refused(untrusted, /^TLS to rediss:\/\/127\.0\.0\.1:\d+\/ failed: self-signed certificate in certificate chain/, "SELF_SIGNED_CERT_IN_CHAIN");
  // No client certificate for a server that asks for one: TLS 1.3's alert comes after the handshake, so the client
  // reads it, or (when its first write comes first) only the reset, named as such once the call timeout is over.
  const anonymous = without(server.tls, "cert", "key");
  const err = await idem.IdemClient.connect(server.url, { callTimeoutMs: 1000, redis: { socket: anonymous } }).then(() => null, (e) => e);
  if (err instanceof idem.OtherRedisError) assert.match(err.message, /certificate required/);
  else assert.match(String(err), /^UnavailableError: no answer within 1000 ms \(last error: .*ECONNRESET: the server ended the TLS connection; does it want a client certificate\?\)/);
  // The password in the URL is masked in the TLS error too.
  await refused(untrusted, /^TLS to rediss:\/\/:\*\*\*@127\.0\.0\.1/, "SELF_SIGNED_CERT_IN_CHAIN", server.url.replace("rediss://", "rediss://:s3cret@"));

  // A certificate for another host.
  const other = await startTlsRedis(certs, { cert: certs.other });
  const byAddress = without(other.tls, "servername");
  await refused(byAddress, /Hostname\/IP does not match certificate's altnames/, "ERR_TLS_CERT_ALTNAME_INVALID", other.url);
});
