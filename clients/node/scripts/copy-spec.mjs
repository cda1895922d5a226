// Copies the repository's spec/ data files into this package's spec/ at
// build and pack time, so the published package reads the same facts the
// Rust crate is tested against (never hand-copied; spec/ here is ignored by git).
import { copyFileSync, mkdirSync, readdirSync, existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const source = join(here, "..", "..", "..", "spec");
const target = join(here, "..", "spec");
export const SHIPPED = ["errors.json", "http.json", "read_through.json", "fence.json"];

if (!SHIPPED.every((name) => existsSync(join(source, name)))) {
  if (SHIPPED.every((name) => existsSync(join(target, name)))) {
    process.exit(0); // an unpacked tarball: it carries its spec/ already
  }
  throw new Error(`the repository's spec/ is missing at ${source}`);
}
mkdirSync(target, { recursive: true });
for (const name of readdirSync(source)) {
  if (name.endsWith(".json")) copyFileSync(join(source, name), join(target, name));
}
