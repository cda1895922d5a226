// Measures IDEM.BEGIN round trips per second through ioredis and node-redis
// against one redis-server with the module, at a fixed concurrency: the
// figures behind the package's choice of Redis client (README).
// Usage: node bench/redis-clients.mjs <redis-url> [seconds] [concurrency]
import { randomBytes } from "node:crypto";
import { Redis } from "ioredis";
import { createClient } from "redis";

const url = process.argv[2];
const seconds = Number(process.argv[3] ?? 5);
const concurrency = Number(process.argv[4] ?? 64);
if (!url) throw new Error("usage: redis-clients.mjs <redis-url> [seconds] [concurrency]");
const fingerprint = randomBytes(32);

async function run(name, begin) {
  let n = 0;
  let k = 0;
  const until = Date.now() + seconds * 1000;
  const worker = async () => {
    while (Date.now() < until) {
      await begin(`bench:${name}:${k++}`);
      n++;
    }
  };
  const t0 = process.hrtime.bigint();
  await Promise.all(Array.from({ length: concurrency }, worker));
  const elapsed = Number(process.hrtime.bigint() - t0) / 1e9;
  return n / elapsed;
}

const io = new Redis(url, { maxRetriesPerRequest: 0, enableAutoPipelining: process.env.AUTO === "1" });
const nr = createClient({ url });
await nr.connect();
const results = { ioredis: [], "node-redis": [] };
// Alternate the clients so neither gets the quieter half of the machine.
for (let round = 0; round < 3; round++) {
  results.ioredis.push(
    await run("io", (key) => io.callBuffer("IDEM.BEGIN", key, fingerprint, "60", "PACKED")),
  );
  results["node-redis"].push(
    await run("nr", (key) =>
      nr.sendCommand(["IDEM.BEGIN", key, fingerprint, "60", "PACKED"], { typeMapping: { 36: Buffer } }),
    ),
  );
}
await io.flushall();
io.disconnect();
await nr.quit();
for (const [name, xs] of Object.entries(results)) {
  const sorted = [...xs].sort((a, b) => a - b);
  console.log(`${name}: median ${Math.round(sorted[1])} BEGIN/s (runs: ${xs.map(Math.round).join(", ")})`);
}
