// Copies the repository's spec/ data files into this package's spec/ at
// build and pack time, so the published package reads the same facts the
// Rust crate is tested against (never hand-copied; spec/ here is ignored by git),
// and the Functions library (functions/idem.lua) into the package's
// functions/, which the client loads into a Redis without the module.
import { copyFileSync, mkdirSync, readdirSync, existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const repo = join(here, "..", "..", "..");
const source = join(repo, "spec");
const target = join(here, "..", "spec");
export const SHIPPED = ["errors.json", "http.json", "read_through.json", "fence.json", "functions.json", "outbox_slots.json"];
export const LIBRARY = "idem.lua";
const librarySource = join(repo, "functions", LIBRARY);
const libraryTarget = join(here, "..", "functions");

if (!SHIPPED.every((name) => existsSync(join(source, name)))) {
  if (SHIPPED.every((name) => existsSync(join(target, name)))) {
    process.exit(0); // an unpacked tarball: it carries its spec/ and functions/ already
  }
  throw new Error(`the repository's spec/ is missing at ${source}`);
}
mkdirSync(target, { recursive: true });
for (const name of readdirSync(source)) {
  if (name.endsWith(".json")) copyFileSync(join(source, name), join(target, name));
}
if (existsSync(librarySource)) {
  mkdirSync(libraryTarget, { recursive: true });
  copyFileSync(librarySource, join(libraryTarget, LIBRARY));
} else if (process.env.npm_lifecycle_event === "prepack") {
  throw new Error(`the Functions library is missing at ${librarySource}: a package without it cannot run where Redis is managed`);
} else {
  process.stderr.write(`copy-spec: no ${librarySource} yet; the functions and scripts backends cannot load the library\n`);
}
