// Test fixtures: a redis-server with the idem module on a free port (never
// 6379 or 6390) and throwaway Postgres databases with the writer's
// migrations (either layout), removed at the end whatever happens.
import { spawn, spawnSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, existsSync, statSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { randomUUID } from "node:crypto";
import { after } from "node:test";
import pg from "pg";
import { createClient } from "@redis/client";

export const REPO = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
export const SPEC = join(REPO, "spec");
const RESERVED = new Set([6379, 6390]);

export function loadSpec(name) {
  return JSON.parse(readFileSync(join(SPEC, name), "utf8"));
}

/** Bytes as the spec writes them: a string (its UTF-8) or {"hex": ...}. */
export function b(v) {
  return typeof v === "string" ? Buffer.from(v, "utf8") : Buffer.from(v.hex, "hex");
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

export function modulePath() {
  if (process.env.IDEM_MODULE) return process.env.IDEM_MODULE;
  const found = ["target/release/module/libidem.so", "target/release/libidem.so"]
    .map((p) => join(REPO, p))
    .filter((p) => existsSync(p));
  if (found.length === 0) throw new Error("libidem.so not built: set IDEM_MODULE or run scripts/test-node.sh");
  return found.sort((x, y) => statSync(y).mtimeMs - statSync(x).mtimeMs)[0];
}

/** A port below the kernel's ephemeral range that nothing listens on. */
export async function freePort() {
  let low = 32768;
  try {
    low = Number(readFileSync("/proc/sys/net/ipv4/ip_local_port_range", "utf8").trim().split(/\s+/)[0]);
  } catch {
    // keep the default
  }
  for (let i = 0; i < 500; i++) {
    const port = 10000 + Math.floor(Math.random() * (Math.max(low, 11000) - 10000));
    if (RESERVED.has(port)) continue;
    const free = await new Promise((resolve) => {
      const s = createServer();
      s.once("error", () => resolve(false));
      s.listen(port, "127.0.0.1", () => s.close(() => resolve(true)));
    });
    if (free) return port;
  }
  throw new Error("no free port");
}

const cleanups = [];
after(async () => {
  for (const f of cleanups.splice(0).reverse()) await f();
});
for (const signal of ["SIGINT", "SIGTERM"]) {
  process.once(signal, async () => {
    for (const f of cleanups.splice(0).reverse()) await f();
    process.exit(130);
  });
}
/** Runs `f` when the test file ends (also on failure). */
export function cleanup(f) {
  cleanups.push(f);
}

/**
 * The servers the client's core tests run against: "module" (the idem module loaded) and "managed" (no module,
 * MODULE renamed away as managed services do; the client loads the Functions library itself).
 * IDEM_TEST_BACKENDS=module (or managed) narrows it.
 */
export const SERVER_KINDS = (process.env.IDEM_TEST_BACKENDS ?? "module,managed").split(",").filter((k) => k !== "");

/** A redis-server with the module, stopped when the file's tests end. */
export async function startRedis(...moduleArgs) {
  return startServer("module", ...moduleArgs);
}

/** A redis-server as a managed service runs it: no module, MODULE renamed away (plus `args`). */
export async function startManagedRedis(...args) {
  return startServer("managed", ...args);
}

/**
 * A redis-server of `kind` ("module": with the module and `args` as its module arguments; "managed": without it,
 * MODULE renamed away, `args` as more server arguments), stopped when the file's tests end.
 */
export async function startServer(kind, ...args) {
  const serverArgs =
    kind === "module" ? ["--loadmodule", modulePath(), ...args] : kind === "managed" ? ["--rename-command", "MODULE", "", ...args] : null;
  if (serverArgs === null) throw new Error(`no server kind ${kind}`);
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), "idem-node-redis-"));
  const server = {
    port,
    dir,
    url: `redis://127.0.0.1:${port}/`,
    proc: null,
    kind,
    async start() {
      this.proc = spawn(
        process.env.IDEM_REDIS_SERVER ?? "redis-server",
        ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir,
          "--logfile", join(dir, "redis.log"), "--enable-debug-command", "yes", ...serverArgs],
        { stdio: "ignore" },
      );
      const deadline = Date.now() + 20000;
      while (Date.now() < deadline) {
        if (this.proc.exitCode !== null) throw new Error(`redis-server exited: ${this.log()}`);
        try {
          const c = createClient({ url: this.url, socket: { reconnectStrategy: false } });
          c.on("error", () => undefined);
          await c.connect();
          await c.ping();
          await c.close();
          return;
        } catch {
          await sleep(20);
        }
      }
      throw new Error(`redis-server not ready: ${this.log()}`);
    },
    async stop() {
      if (this.proc !== null && this.proc.exitCode === null) {
        const exited = new Promise((resolve) => this.proc.once("exit", resolve));
        this.proc.kill("SIGKILL");
        await exited;
      }
      this.proc = null;
    },
    log() {
      try {
        return readFileSync(join(dir, "redis.log"), "utf8");
      } catch {
        return "";
      }
    },
    /** A plain node-redis client for the test's own commands. */
    async raw() {
      const c = createClient({ url: this.url });
      c.on("error", () => undefined);
      await c.connect();
      cleanup(() => (c.isOpen ? c.close() : undefined));
      return c;
    },
  };
  cleanup(async () => {
    await server.stop();
    rmSync(dir, { recursive: true, force: true });
  });
  await server.start();
  return server;
}

export const ADMIN_URL = process.env.DATABASE_URL ?? "postgresql://postgres@127.0.0.1:5432/postgres";

function withDb(url, name) {
  const u = new URL(url);
  u.pathname = `/${name}`;
  return u.toString();
}

async function admin(sql) {
  const c = new pg.Client({ connectionString: ADMIN_URL });
  await c.connect();
  try {
    await c.query(sql);
  } finally {
    await c.end();
  }
}

/** The writer's migrations for `layout`, in order (crates/idem-writer/migrations). */
export function migrations(layout = "unpartitioned") {
  const dir = join(REPO, "crates/idem-writer/migrations");
  const files = readdirSync(dir).filter((f) => f.endsWith(".sql")).sort();
  const first = layout === "partitioned" ? "0001_idempotency_keys_partitioned.sql" : "0001_idempotency_keys.sql";
  return [first, ...files.filter((f) => !f.startsWith("0001_"))].map((f) => readFileSync(join(dir, f), "utf8"));
}

/** An empty database of its own, dropped when the file's tests end (the example migrates it itself). */
export async function emptyDatabase() {
  const name = `idem_node_${randomUUID().replaceAll("-", "").slice(0, 12)}`;
  await admin(`CREATE DATABASE "${name}"`);
  const url = withDb(ADMIN_URL, name);
  const pools = [];
  cleanup(async () => {
    for (const p of pools) await p.end().catch(() => undefined);
    await admin(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
  });
  return {
    url,
    name,
    pool(max = 4) {
      const p = new pg.Pool({ connectionString: url, max });
      p.on("error", () => undefined);
      pools.push(p);
      return p;
    },
  };
}

/**
 * A database of its own with idempotency_keys (and a payments table for the fence), dropped when the file's tests end.
 * `layout` "partitioned" has one partition for every expiry; "daily" is partitioned by day from today to today + 3
 * (UTC), as the writer makes them, so a takeover with a two-day TTL moves the row to another partition.
 */
export async function database(layout = "unpartitioned") {
  const name = `idem_node_${randomUUID().replaceAll("-", "").slice(0, 12)}`;
  await admin(`CREATE DATABASE "${name}"`);
  const url = withDb(ADMIN_URL, name);
  const pools = [];
  cleanup(async () => {
    for (const p of pools) await p.end().catch(() => undefined);
    await admin(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
  });
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  try {
    for (const sql of migrations(layout === "daily" ? "partitioned" : layout)) await c.query(sql);
    await c.query("CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, amount INT)");
    if (layout === "partitioned") {
      await c.query(
        "CREATE TABLE idempotency_keys_all PARTITION OF idempotency_keys FOR VALUES FROM (MINVALUE) TO ('9999-12-31 00:00:00+00')",
      );
    }
    if (layout === "daily") {
      await c.query(`DO $$ DECLARE d date; BEGIN
        FOR d IN SELECT generate_series(0, 3) + (now() AT TIME ZONE 'UTC')::date LOOP
          EXECUTE format('CREATE TABLE %I PARTITION OF idempotency_keys FOR VALUES FROM (%L) TO (%L)',
            'idempotency_keys_p' || to_char(d, 'YYYYMMDD'), d || ' 00:00:00+00', (d + 1) || ' 00:00:00+00');
        END LOOP; END $$`);
    }
  } finally {
    await c.end();
  }
  return {
    url,
    name,
    /** A pool on the database, ended when the file's tests end; `options` go to pg.Pool (e.g. `{ pipeline: true }`). */
    pool(max = 8, options = {}) {
      const p = new pg.Pool({ connectionString: url, max, ...options });
      p.on("error", () => undefined);
      pools.push(p);
      return p;
    },
  };
}

/** A key no other test uses. */
export function key() {
  return `idem:{t:${randomUUID().replaceAll("-", "")}}`;
}

/**
 * A throwaway certificate authority with certificates signed by it, removed when the file's tests end: "server"
 * (for 127.0.0.1 and localhost), "other" (for other.example only), "client", and "postgres" (a client certificate
 * for Postgres' user postgres: its CN). Each is { crt, key } file paths.
 */
export function certificates() {
  const dir = mkdtempSync(join(tmpdir(), "idem-node-certs-"));
  cleanup(() => rmSync(dir, { recursive: true, force: true }));
  const run = (...args) => {
    const r = spawnSync("openssl", args, { cwd: dir, stdio: ["ignore", "ignore", "pipe"] });
    if (r.status !== 0) throw new Error(`openssl ${args[0]}: ${r.stderr}`);
  };
  run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=idem test CA");
  const out = { dir, ca: join(dir, "ca.crt") };
  for (const [name, san] of [["server", "IP:127.0.0.1,DNS:localhost"], ["other", "DNS:other.example"], ["client", "DNS:client"], ["postgres", "DNS:postgres"]]) {
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", `${name}.key`, "-out", `${name}.csr`, "-subj", `/CN=${name}`);
    writeFileSync(join(dir, `${name}.ext`), `subjectAltName=${san}\n`);
    run("x509", "-req", "-in", `${name}.csr`, "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", `${name}.crt`, "-days", "2", "-extfile", `${name}.ext`);
    out[name] = { crt: join(dir, `${name}.crt`), key: join(dir, `${name}.key`) };
  }
  return out;
}

/**
 * A TLS-only redis-server as a managed service runs it (no module, MODULE renamed away), presenting `cert` (one of
 * certificates()'s) and asking clients for a certificate when `authClients`; stopped when the file's tests end.
 * `url` is its rediss:// URL; `tls` the node-redis socket options of a client that trusts it and has a certificate.
 */
export async function startTlsRedis(certs, { cert = certs.server, authClients = true } = {}) {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), "idem-node-redis-"));
  const proc = spawn(
    process.env.IDEM_REDIS_SERVER ?? "redis-server",
    ["--port", "0", "--tls-port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir,
      "--logfile", join(dir, "redis.log"), "--tls-cert-file", cert.crt, "--tls-key-file", cert.key, "--tls-ca-cert-file", certs.ca,
      "--tls-auth-clients", authClients ? "yes" : "no", "--rename-command", "MODULE", ""],
    { stdio: "ignore" },
  );
  cleanup(async () => {
    if (proc.exitCode === null) {
      const exited = new Promise((resolve) => proc.once("exit", resolve));
      proc.kill("SIGKILL");
      await exited;
    }
    rmSync(dir, { recursive: true, force: true });
  });
  const tls = { tls: true, ca: readFileSync(certs.ca), cert: readFileSync(certs.client.crt), key: readFileSync(certs.client.key), servername: "localhost" };
  const url = `rediss://127.0.0.1:${port}/`;
  const deadline = Date.now() + 20000;
  while (Date.now() < deadline) {
    if (proc.exitCode !== null) throw new Error(`redis-server exited: ${readFileSync(join(dir, "redis.log"), "utf8")}`);
    const c = createClient({ url, socket: { ...tls, checkServerIdentity: () => undefined, reconnectStrategy: false } });
    c.on("error", () => undefined);
    try {
      await c.connect();
      await c.ping();
      await c.close();
      return { port, url, tls };
    } catch {
      if (c.isOpen) c.destroy();
      await sleep(20);
    }
  }
  throw new Error("redis-server (TLS) not ready");
}

/**
 * A throwaway Postgres cluster that takes only TLS connections with a client certificate (hostssl ... cert: the
 * certificate's CN is the user), presenting certs.server; stopped and removed when the file's tests end. Its
 * `url(params)` is a postgresql:// URL for user postgres on localhost with `params` (sslmode, sslcert, ...).
 */
export async function startTlsPostgres(certs) {
  const bin = readdirSync("/usr/lib/postgresql").sort().map((v) => join("/usr/lib/postgresql", v, "bin")).pop();
  const root = mkdtempSync(join(tmpdir(), "idem-node-pg-"));
  const data = join(root, "data");
  const asPostgres = (cmd, ...args) => {
    const [file, argv] = process.getuid?.() === 0 ? ["runuser", ["-u", "postgres", "--", cmd, ...args]] : [cmd, args];
    const r = spawnSync(file, argv, { stdio: ["ignore", "ignore", "pipe"] });
    if (r.status !== 0) throw new Error(`${cmd}: ${r.stderr}`);
  };
  spawnSync("chmod", ["755", root]);
  if (process.getuid?.() === 0) spawnSync("chown", ["postgres", root]);
  const port = await freePort();
  cleanup(() => {
    if (existsSync(join(data, "postmaster.pid"))) {
      try {
        asPostgres(join(bin, "pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop");
      } catch {
        // already gone
      }
    }
    rmSync(root, { recursive: true, force: true });
  });
  asPostgres(join(bin, "initdb"), "-D", data, "-U", "postgres", "--auth=trust");
  for (const [from, to] of [[certs.server.crt, "server.crt"], [certs.server.key, "server.key"], [certs.ca, "ca.crt"]]) {
    writeFileSync(join(data, to), readFileSync(from), { mode: 0o600 });
    if (process.getuid?.() === 0) spawnSync("chown", ["postgres", join(data, to)]);
  }
  writeFileSync(join(data, "pg_hba.conf"), "hostssl all all 127.0.0.1/32 cert\nhostssl all all ::1/128 cert\n");
  asPostgres(join(bin, "pg_ctl"), "-D", data, "-l", join(root, "server.log"), "-w", "start", "-o",
    `-p ${port} -c listen_addresses=localhost -c unix_socket_directories=${root} -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c ssl_ca_file=ca.crt -c fsync=off`);
  return {
    port,
    url(params = {}) {
      const u = new URL(`postgresql://postgres@localhost:${port}/postgres`);
      for (const [k, v] of Object.entries(params)) u.searchParams.set(k, v);
      return u.toString();
    },
  };
}
