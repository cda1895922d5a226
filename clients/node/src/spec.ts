// The repository's spec/ data files, which this package reads instead of
// copying their facts: shipped in the package as spec/ (copied at build and
// pack time by scripts/copy-spec.mjs); in a checkout without that copy, read
// from the repository's spec/. The Functions library (functions/idem.lua) is
// shipped the same way, as functions/idem.lua in the package.
import { existsSync, readFileSync } from "node:fs";

const cache = new Map<string, unknown>();

function path(name: string, dir = "spec"): URL {
  const shipped = new URL(`../${dir}/${name}`, import.meta.url);
  if (existsSync(shipped)) return shipped;
  return new URL(`../../../${dir}/${name}`, import.meta.url);
}

/** One spec file, parsed (`errors.json`, `http.json`, `fence.json`, `read_through.json`). */
export function load(name: string): unknown {
  let doc = cache.get(name);
  if (doc === undefined) {
    doc = JSON.parse(readFileSync(path(name), "utf8")) as unknown;
    cache.set(name, doc);
  }
  return doc;
}

export interface ErrorsSpec {
  module_codes: { name: string; code: string; meaning: string }[];
  transient_codes: string[];
  unavailable_codes: string[];
  writes_refused_codes: string[];
  configuration_codes: string[];
  packed_refused_detail: string;
}

export interface Problem {
  status: number;
  type: string;
  title: string;
  detail: string | null;
  retry_after?: string;
}

export type ProblemName =
  | "missing_key"
  | "invalid_key"
  | "request_too_large"
  | "unreadable_request"
  | "in_flight"
  | "mismatch"
  | "missing_tenant"
  | "invalid_tenant"
  | "unavailable"
  | "internal";

export interface HttpSpec {
  headers: {
    idempotency_key: string;
    replayed: string;
    replayed_value: string;
    retry_after: string;
    content_type: string;
    problem_content_type: string;
  };
  problems: Record<ProblemName, Problem>;
  key_errors: Record<"empty" | "too_long" | "malformed" | "repeated", string>;
  defaults: {
    methods: string[];
    header: string;
    required: boolean;
    max_tenant_bytes: number;
    key_prefix: string;
    ttl_ms: number;
    lease_ms: number;
    max_request_body: number;
    max_response_body: number;
    stored_headers: string[];
    fail_open: boolean;
    store_retry_ms: number;
    store_at_once_ms: number;
    store_pause_first_ms: number;
    store_pause_max_ms: number;
    max_retry_after_ms: number;
    fence_retry_after_ms: number;
    canonical_json: boolean;
    call_timeout_ms: number;
    read_through_timeout_ms: number;
  };
}

export interface FenceSpec {
  lock_seed: number;
  /** How the completion fails when asked to and the row is not held. */
  not_held: { sqlstate: string; message_contains: string };
  /** How a completion fails when a takeover moved the row to another partition (the partitioned layout). */
  moved: { sqlstate: string };
  statements: Record<
    "claim" | "partitioned_gate" | "partitioned_claim" | "row" | "complete" | "renew" | "release",
    { params: string[]; sql: string }
  > & {
    /** The completion and the caller's effect in one statement: `effect_placeholder` in `sql` stands for the effect, whose parameters start at `effect_first_param`. */
    complete_with_effect: { params: string[]; sql: string; effect_placeholder: string; effect_first_param: number };
  };
}

export interface ReadThroughSpec {
  lookup_sql: string;
  timeout_ms: number;
}

export const errors = (): ErrorsSpec => load("errors.json") as ErrorsSpec;
export const http = (): HttpSpec => load("http.json") as HttpSpec;
export const fence = (): FenceSpec => load("fence.json") as FenceSpec;
export const readThrough = (): ReadThroughSpec => load("read_through.json") as ReadThroughSpec;

export interface FunctionsSpec {
  library: string;
  source: string;
  version: number;
  functions: Record<
    "begin" | "complete" | "abort" | "touch" | "get" | "mirror_claim" | "mirror_ack" | "version",
    { name: string; module: string | null; keys: string[]; args: string; flags?: string[] }
  >;
  errors: { missing_function: string; missing_script: string };
}

export interface OutboxSlotsSpec {
  prefix: string;
  suffix: string;
  tags: string[];
}

export const functions = (): FunctionsSpec => load("functions.json") as FunctionsSpec;
export const outboxSlots = (): OutboxSlotsSpec => load("outbox_slots.json") as OutboxSlotsSpec;

let library: string | undefined;

/** Where the Functions library's source is read from: the package's functions/idem.lua, else the repository's. */
export function libraryPath(): URL {
  const name = functions().source.replace(/^functions\//, "");
  return path(name, "functions");
}

/** The Functions library's source (functions/idem.lua), as FUNCTION LOAD takes it. */
export function librarySource(): string {
  library ??= readFileSync(libraryPath(), "utf8");
  return library;
}
