// RFC 8785 JSON Canonicalization Scheme (JCS) as idem applies it to request
// bodies, byte for byte what the Rust client's canonical_json produces (held
// to spec/vectors/canonical_json.json and the RFC 8785 corpus):
// - the body must be RFC 8259 JSON in UTF-8 (no BOM, no unpaired
//   surrogates, no number beyond a double's range, at most 127 levels of
//   nesting), else it is not JSON and canonicalize answers null (callers
//   then take the raw bytes);
// - numbers are IEEE-754 doubles written as ECMAScript writes them;
// - a repeated member name keeps its last value;
// - members are sorted by their names' UTF-16 code units, strings carry the
//   minimal escapes, and nothing is added between tokens.

/** Deepest nesting of arrays and objects accepted (as the Rust parser). */
export const MAX_DEPTH = 127;

class NotJson extends Error {}

const UTF8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

/** The canonical form of a JSON document, or null when it is not JSON. */
export function canonicalize(data: Uint8Array): Buffer | null {
  let text: string;
  try {
    text = UTF8.decode(data);
  } catch {
    return null;
  }
  if (text.startsWith("\ufeff")) return null;
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return null;
  }
  const out: string[] = [];
  try {
    write(value, out, 0);
  } catch (err) {
    if (err instanceof NotJson) return null;
    throw err;
  }
  return Buffer.from(out.join(""), "utf8");
}

function write(value: unknown, out: string[], depth: number): void {
  if (value === null) out.push("null");
  else if (value === true) out.push("true");
  else if (value === false) out.push("false");
  else if (typeof value === "number") {
    if (!Number.isFinite(value)) throw new NotJson("number out of range");
    out.push(formatDouble(value));
  } else if (typeof value === "string") writeString(value, out);
  else if (Array.isArray(value)) {
    if (depth >= MAX_DEPTH) throw new NotJson("too deep");
    out.push("[");
    value.forEach((item, i) => {
      if (i > 0) out.push(",");
      write(item, out, depth + 1);
    });
    out.push("]");
  } else if (typeof value === "object") {
    if (depth >= MAX_DEPTH) throw new NotJson("too deep");
    const obj = value as Record<string, unknown>;
    // JavaScript compares strings by their UTF-16 code units, as RFC 8785 sorts.
    const names = Object.keys(obj).sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
    out.push("{");
    names.forEach((name, i) => {
      if (i > 0) out.push(",");
      writeString(name, out);
      out.push(":");
      write(obj[name], out, depth + 1);
    });
    out.push("}");
  } else {
    throw new NotJson(typeof value);
  }
}

const ESCAPES: Record<string, string> = {
  '"': '\\"',
  "\\": "\\\\",
  "\b": "\\b",
  "\t": "\\t",
  "\n": "\\n",
  "\f": "\\f",
  "\r": "\\r",
};

function writeString(s: string, out: string[]): void {
  if (!s.isWellFormed()) throw new NotJson("unpaired surrogate");
  out.push('"');
  let start = 0;
  for (let i = 0; i < s.length; i++) {
    const ch = s[i] as string;
    if (ch in ESCAPES || ch < " ") {
      out.push(s.slice(start, i), ESCAPES[ch] ?? `\\u${ch.charCodeAt(0).toString(16).padStart(4, "0")}`);
      start = i + 1;
    }
  }
  out.push(s.slice(start), '"');
}

/** ECMAScript Number.prototype.toString of a finite double (RFC 8785 section 3.2.2.3); -0 is "0". */
export function formatDouble(value: number): string {
  if (!Number.isFinite(value)) throw new RangeError(`JSON cannot carry ${value}`);
  return Object.is(value, -0) ? "0" : String(value);
}
