//! The language-neutral contract in `spec/` held to this crate: every vector
//! file under `spec/vectors/` and the data files `spec/errors.json` and
//! `spec/http.json` are read, and the Rust implementation must produce
//! exactly what they expect. The Python (and any later) client reads the same
//! files, so a key sent to a Rust and to a Python service is the same
//! request, and a fingerprint never changes across releases (a changed one
//! turns every retry into a 422).
//!
//! `IDEM_SPEC_FILL=1` writes the Rust answer into cases that have no
//! expectation yet (new cases); an expectation already in a file is never
//! rewritten, only checked.

#![cfg(all(feature = "middleware", feature = "postgres"))]

use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use axum::routing::post;
use axum::Router;
use idem_client::canonical_json::{canonicalize, format_double};
use idem_client::middleware::{
    check_tenant, default_store_policy, parse_key_header, redis_key, KeyError, Problem,
    TenantError, IDEMPOTENT_REPLAYED, MAX_KEY_BYTES, MAX_TENANT_BYTES,
};
use idem_client::{
    Fence, Fingerprinter, IdemClient, IdemError, IdempotencyLayer, MemoryStore,
    DEFAULT_CALL_TIMEOUT, DEFAULT_LOOKUP_TIMEOUT,
};
use idem_core::args::{self, name, Abort, BeginArgs, CompleteArgs, Encode, KeyToken, Touch};
use idem_core::wire::{
    parse_pull_batch, parse_record, write_pull_batch, write_record, Begin, BeginReply, ErrorCode,
    Frame, Recorder, ReplayLayout, StoredResponse,
};
use idem_core::{Completed, Fingerprint, Header, MirrorState, Record, State};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use tower::ServiceExt;

fn spec_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the crate sits two levels below the workspace root")
        .join("spec")
}

/// One spec file, read; written back on drop when a case was filled.
struct SpecFile {
    path: PathBuf,
    doc: Value,
    filled: usize,
}

impl SpecFile {
    fn open(relative: &str) -> SpecFile {
        let path = spec_dir().join(relative);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let doc = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{relative}: {e}"));
        SpecFile {
            path,
            doc,
            filled: 0,
        }
    }

    /// The cases under `field`, each handed to `check` mutably (for filling).
    fn cases(&mut self, field: &str, mut check: impl FnMut(&mut Map<String, Value>) -> usize) {
        let cases = self.doc[field]
            .as_array_mut()
            .unwrap_or_else(|| panic!("{}: no array {field:?}", self.path.display()));
        assert!(!cases.is_empty(), "{field}: no cases");
        for case in cases {
            let case = case.as_object_mut().expect("a case is an object");
            self.filled += check(case);
        }
    }
}

impl Drop for SpecFile {
    fn drop(&mut self) {
        if self.filled > 0 && !std::thread::panicking() {
            let text = serde_json::to_string_pretty(&self.doc).expect("serializable") + "\n";
            std::fs::write(&self.path, text).expect("write the filled spec file");
            eprintln!("{}: filled {} case(s)", self.path.display(), self.filled);
        }
    }
}

fn filling() -> bool {
    std::env::var_os("IDEM_SPEC_FILL").is_some_and(|v| v == "1")
}

/// Checks `case[field]` against `actual`, or fills it in when it is missing
/// and filling is on; answers how many fields were filled.
fn expect(case: &mut Map<String, Value>, field: &str, actual: Value) -> usize {
    let what = case
        .get("name")
        .map_or_else(|| Value::Object(case.clone()).to_string(), Value::to_string);
    match case.get(field) {
        Some(expected) => {
            assert_eq!(expected, &actual, "{what}: {field}");
            0
        }
        None if filling() => {
            case.insert(field.to_string(), actual);
            1
        }
        None => panic!("{what}: no {field:?} (IDEM_SPEC_FILL=1 fills in new cases)"),
    }
}

/// Bytes as the spec writes them: a JSON string (its UTF-8) or `{"hex": ..}`.
fn bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::String(s) => s.as_bytes().to_vec(),
        Value::Object(o) => {
            hex::decode(o["hex"].as_str().expect("hex is a string")).expect("hex decodes")
        }
        other => panic!("not bytes: {other}"),
    }
}

/// Bytes in the spec's form: text when they are UTF-8, else hex.
fn to_bytes_value(b: &[u8]) -> Value {
    match std::str::from_utf8(b) {
        Ok(text) => Value::String(text.to_string()),
        Err(_) => json!({ "hex": hex::encode(b) }),
    }
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v}"))
}

fn uint(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not an unsigned integer: {v}"))
}

fn pairs(v: &Value) -> Vec<(Vec<u8>, Vec<u8>)> {
    v.as_array()
        .expect("a list of pairs")
        .iter()
        .map(|p| (bytes(&p[0]), bytes(&p[1])))
        .collect()
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

// ---------------------------------------------------------------- fingerprints

/// The spec's framing, built by hand from its description.
struct Framing(Vec<u8>);

impl Framing {
    fn count(&mut self, n: usize) {
        self.0.extend_from_slice(&(n as u64).to_be_bytes());
    }
    fn field(&mut self, b: &[u8]) {
        self.count(b.len());
        self.0.extend_from_slice(b);
    }
}

/// The spec's rule for a JSON content type (`framing.json_content_type`).
fn spec_is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get("content-type") else {
        return false;
    };
    let raw = value.as_bytes();
    if !raw.iter().all(|&b| b == b'\t' || (0x20..0x7f).contains(&b)) {
        return false;
    }
    let text = std::str::from_utf8(raw).expect("ASCII");
    let essence = text
        .split(';')
        .next()
        .unwrap_or_default()
        .trim_matches([' ', '\t'])
        .to_ascii_lowercase();
    essence == "application/json" || (essence.contains('/') && essence.ends_with("+json"))
}

#[test]
fn fingerprints() {
    let mut file = SpecFile::open("vectors/fingerprint.json");
    let framing = file.doc["framing"].clone();
    assert_eq!(framing["tag"], "idem-fingerprint-v1");
    file.cases("cases", |case| {
        let config = &case["fingerprinter"];
        let canonical = config["canonical_json"].as_bool().expect("a bool");
        let mut fingerprinter = Fingerprinter::new().canonical_json(canonical);
        let mut names: Vec<HeaderName> = Vec::new();
        for name in config["headers"].as_array().expect("names") {
            let name = HeaderName::from_bytes(text(name).as_bytes()).expect("a header name");
            fingerprinter = fingerprinter.header(name.clone());
            if !names.contains(&name) {
                names.push(name);
            }
        }
        let request = &case["request"];
        let method = Method::from_bytes(text(&request["method"]).as_bytes()).expect("method");
        let target = text(&request["target"]);
        let uri: Uri = target.parse().expect("a request target");
        let mut headers = HeaderMap::new();
        for (name, value) in pairs(&request["headers"]) {
            headers.append(
                HeaderName::from_bytes(&name).expect("header name"),
                HeaderValue::from_bytes(&value).expect("header value"),
            );
        }
        let body = bytes(&request["body"]);
        let fingerprint = fingerprinter.fingerprint(&method, &uri, &headers, &body);

        // The framing as the spec describes it gives the same digest.
        let canonical_body = if canonical && spec_is_json(&headers) {
            canonicalize(&body)
        } else {
            None
        };
        let mut framed = Framing(text(&framing["tag"]).as_bytes().to_vec());
        framed.field(method.as_str().as_bytes());
        framed.field(target.as_bytes());
        framed.count(names.len());
        for name in &names {
            framed.field(name.as_str().as_bytes());
            let values: Vec<&HeaderValue> = headers.get_all(name).iter().collect();
            framed.count(values.len());
            for value in values {
                framed.field(value.as_bytes());
            }
        }
        match &canonical_body {
            Some(canonical) => {
                framed.0.push(1);
                framed.field(canonical);
            }
            None => {
                framed.0.push(0);
                framed.field(&body);
            }
        }
        assert_eq!(
            Sha256::digest(&framed.0).as_slice(),
            fingerprint.as_bytes(),
            "{}: the spec's framing",
            case["name"]
        );

        let mut expected = json!({
            "body": if canonical_body.is_some() { "canonical" } else { "raw" },
            "fingerprint": hex::encode(fingerprint.as_bytes()),
            "stored_hex": fingerprint.stored_hex(),
        });
        if let Some(canonical) = &canonical_body {
            expected["canonical_body"] = to_bytes_value(canonical);
        }
        assert_eq!(fingerprint.stored_hex(), sha256_hex(fingerprint.as_bytes()));
        expect(case, "expected", expected)
    });
}

// ---------------------------------------------------------------- canonical JSON

#[test]
fn canonical_json() {
    let mut file = SpecFile::open("vectors/canonical_json.json");
    file.cases("cases", |case| {
        let input = bytes(&case["input"]);
        let actual = canonicalize(&input).map_or(Value::Null, |out| {
            Value::String(String::from_utf8(out).expect("canonical JSON is UTF-8"))
        });
        expect(case, "expected", actual)
    });
}

#[test]
fn rfc8785_corpus() {
    let mut file = SpecFile::open("vectors/rfc8785.json");
    file.cases("cases", |case| {
        let input = bytes(&case["input"]);
        let out = canonicalize(&input).expect("the corpus is JSON");
        assert_eq!(
            String::from_utf8(out).expect("UTF-8"),
            text(&case["expected"]),
            "{}",
            case["name"]
        );
        0
    });
    file.cases("numbers", |case| {
        let bits = u64::from_str_radix(text(&case["ieee_hex"]), 16).expect("hex bits");
        let value = f64::from_bits(bits);
        match &case["expected"] {
            Value::Null => assert!(!value.is_finite(), "{bits:#x}"),
            expected => assert_eq!(format_double(value), text(expected), "{bits:#x}"),
        }
        0
    });
    assert!(spec_dir().join("vectors/rfc8785.LICENSE").is_file());
}

// ---------------------------------------------------------------- keys

#[test]
fn keys() {
    let mut file = SpecFile::open("vectors/keys.json");
    assert_eq!(uint(&file.doc["max_key_bytes"]) as usize, MAX_KEY_BYTES);
    file.cases("header", |case| {
        let lines: Vec<Vec<u8>> = case["lines"]
            .as_array()
            .unwrap()
            .iter()
            .map(bytes)
            .collect();
        let actual = match &lines[..] {
            [] => json!({ "absent": true }),
            [line] => match parse_key_header(line) {
                Ok(key) => json!({ "key": key }),
                Err(err) => json!({ "error": key_error_kind(&err) }),
            },
            // Checked through the layer in `the_layer_answers_as_the_spec_says`.
            _ => json!({ "error": "repeated" }),
        };
        expect(case, "expected", actual)
    });
    file.cases("redis_key", |case| {
        let actual = redis_key(
            text(&case["prefix"]),
            text(&case["tenant"]),
            text(&case["key"]),
        );
        expect(case, "expected", Value::String(actual))
    });
    file.cases("tenant", |case| {
        let lines: Vec<Vec<u8>> = case["lines"]
            .as_array()
            .unwrap()
            .iter()
            .map(bytes)
            .collect();
        let actual = spec_tenant(&lines).map_or(Value::Null, Value::String);
        expect(case, "expected", actual)
    });
    assert_eq!(
        uint(&file.doc["max_tenant_bytes"]) as usize,
        MAX_TENANT_BYTES
    );
    file.cases("tenant_check", |case| {
        let tenant = match (case.get("lines"), case.get("value")) {
            (Some(lines), None) => {
                let lines: Vec<Vec<u8>> = lines.as_array().unwrap().iter().map(bytes).collect();
                spec_tenant(&lines)
            }
            (None, Some(value)) => value.as_str().map(str::to_owned),
            _ => panic!("a tenant_check case has lines or a value: {case:?}"),
        };
        expect(case, "expected", tenant_check_json(check_tenant(tenant)))
    });
}

fn tenant_check_json(checked: Result<String, TenantError>) -> Value {
    match checked {
        Ok(tenant) => json!({ "tenant": tenant }),
        Err(TenantError::Missing) => json!({ "error": "missing_tenant" }),
        Err(TenantError::TooLong) => json!({ "error": "invalid_tenant" }),
    }
}

fn key_error_kind(err: &KeyError) -> &'static str {
    match err {
        KeyError::Empty => "empty",
        KeyError::TooLong => "too_long",
        KeyError::Malformed => "malformed",
        KeyError::Repeated => "repeated",
    }
}

/// The tenant as the spec describes it; the layer is held to it in
/// `tenants_scope_keys_as_the_spec_says`.
fn spec_tenant(lines: &[Vec<u8>]) -> Option<String> {
    if lines.is_empty() {
        return None;
    }
    let combined = lines.join(&b", "[..]);
    Some(match String::from_utf8(combined) {
        Ok(text) => text,
        Err(err) => format!("\0{}", hex::encode(err.as_bytes())),
    })
}

/// A layer over a `MemoryStore` around a handler answering 201 with three
/// headers (`PUT` too, to see it pass through).
fn layered(layer: IdempotencyLayer<MemoryStore>) -> Router {
    let handler = || async {
        (
            StatusCode::CREATED,
            [
                ("content-type", "application/json"),
                ("location", "/p/1"),
                ("x-other", "not stored"),
            ],
            "{}",
        )
    };
    Router::new()
        .route("/p", post(handler).put(handler))
        .layer(layer)
}

async fn call(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, Vec<u8>) {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.expect("body");
    (parts.status, parts.headers, body.to_vec())
}

async fn get_record(store: &MemoryStore, key: &str) -> Option<Record> {
    let mut conn = store.clone();
    idem_testkit::wire::idem_get_async(&mut conn, key).await
}

#[tokio::test]
async fn tenants_scope_keys_as_the_spec_says() {
    let file = SpecFile::open("vectors/keys.json");
    for case in file.doc["tenant"].as_array().unwrap() {
        let store = MemoryStore::new();
        let layer = IdempotencyLayer::new(IdemClient::memory(store.clone()))
            .tenant_header(HeaderName::from_static("x-account-id"));
        let app = layered(layer);
        let mut request = Request::post("/p").header("idempotency-key", "k");
        for line in case["lines"].as_array().unwrap() {
            request = request.header(
                "x-account-id",
                HeaderValue::from_bytes(&bytes(line)).unwrap(),
            );
        }
        let (status, _, body) = call(&app, request.body(Body::from("{}")).unwrap()).await;
        match case["expected"]
            .as_str()
            .filter(|tenant| !tenant.is_empty())
        {
            Some(tenant) => {
                assert_eq!(status, StatusCode::CREATED, "{case}");
                let key = redis_key("idem:", tenant, "k");
                assert!(get_record(&store, &key).await.is_some(), "{case}: {key:?}");
            }
            // A layer with a tenant source never uses the anonymous scope.
            None => {
                assert_eq!(status, StatusCode::BAD_REQUEST, "{case}");
                let body: Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(body["type"], "urn:idem:problem:missing-tenant", "{case}");
                assert!(get_record(&store, &redis_key("idem:", "", "k"))
                    .await
                    .is_none());
            }
        }
    }
}

/// The layer answers every `tenant_check` case as the spec says, with a
/// tenant header or a tenant callback, and never calls Redis for a refused
/// tenant; without a tenant source the same requests all run, in the
/// anonymous scope.
#[tokio::test]
async fn the_layer_checks_tenants_as_the_spec_says() {
    let file = SpecFile::open("vectors/keys.json");
    let http = SpecFile::open("http.json");
    for case in file.doc["tenant_check"].as_array().unwrap() {
        let store = MemoryStore::new();
        let client = IdemClient::memory(store.clone());
        let mut request = Request::post("/p").header("idempotency-key", "k");
        let layer = match (case.get("lines"), case.get("value")) {
            (Some(lines), None) => {
                for line in lines.as_array().unwrap() {
                    request = request.header(
                        "x-account-id",
                        HeaderValue::from_bytes(&bytes(line)).unwrap(),
                    );
                }
                IdempotencyLayer::new(client).tenant_header(HeaderName::from_static("x-account-id"))
            }
            (None, Some(value)) => {
                let value = value.as_str().map(str::to_owned);
                IdempotencyLayer::new(client).tenant(move |_| value.clone())
            }
            _ => panic!("{case}"),
        };
        let app = layered(layer);
        let request = request.body(Body::from("{}")).unwrap();
        let (status, headers, body) = call(&app, request).await;
        let expected = &case["expected"];
        if let Some(tenant) = expected.get("tenant") {
            assert_eq!(status, StatusCode::CREATED, "{case}");
            let key = redis_key("idem:", text(tenant), "k");
            assert!(key.len() <= 2048, "mirrorable");
            assert!(get_record(&store, &key).await.is_some(), "{case}: {key:?}");
            continue;
        }
        let spec = &http.doc["problems"][text(&expected["error"])];
        assert_eq!(u64::from(status.as_u16()), uint(&spec["status"]), "{case}");
        assert_eq!(headers["content-type"], "application/problem+json");
        let detail = text(&spec["detail"]);
        assert_eq!(
            String::from_utf8(body).unwrap(),
            problem_body(spec, detail),
            "{case}"
        );
        // Nothing was stored: not in the anonymous scope, nor in the scope
        // the refused tenant would have named.
        let mut refused = vec![String::new()];
        if let Some(lines) = case.get("lines") {
            let lines: Vec<Vec<u8>> = lines.as_array().unwrap().iter().map(bytes).collect();
            refused.extend(spec_tenant(&lines));
        }
        refused.extend(case.get("value").and_then(Value::as_str).map(str::to_owned));
        for tenant in refused {
            let key = redis_key("idem:", &tenant, "k");
            assert!(get_record(&store, &key).await.is_none(), "{case}");
        }
    }
    // No tenant source: the tenant header is not looked at.
    let store = MemoryStore::new();
    let app = layered(IdempotencyLayer::new(IdemClient::memory(store.clone())));
    for tenant in ["", "acct_1", &"a".repeat(8192)] {
        let request = Request::post("/p")
            .header("idempotency-key", "k")
            .header("x-account-id", tenant)
            .body(Body::from("{}"))
            .unwrap();
        let (status, _, _) = call(&app, request).await;
        assert_eq!(status, StatusCode::CREATED);
    }
    assert!(get_record(&store, &redis_key("idem:", "", "k"))
        .await
        .is_some());
}

// ---------------------------------------------------------------- fence

#[test]
fn downstream_keys() {
    let mut file = SpecFile::open("vectors/downstream_key.json");
    file.cases("cases", |case| {
        let key = text(&case["key"]);
        let fingerprint = bytes(&case["fingerprint"]);
        let fence = Fence::new(key, 1, &fingerprint, Duration::from_secs(60));
        let actual = fence.downstream_key();
        // As the description says.
        let mut framed = (key.len() as u64).to_be_bytes().to_vec();
        framed.extend_from_slice(key.as_bytes());
        framed.extend_from_slice(sha256_hex(&fingerprint).as_bytes());
        assert_eq!(actual, sha256_hex(&framed), "{key}");
        expect(case, "expected", Value::String(actual))
    });
}

// ---------------------------------------------------------------- replies

fn frame_to_json(frame: &Frame) -> Value {
    match frame {
        Frame::Int(n) => json!({ "int": n }),
        Frame::Bulk(b) => json!({ "bulk": to_bytes_value(b) }),
        Frame::Simple(s) => json!({ "simple": s }),
        Frame::Null => json!({ "null": null }),
        Frame::Array(items) => {
            json!({ "array": items.iter().map(frame_to_json).collect::<Vec<_>>() })
        }
    }
}

fn frame_from_json(v: &Value) -> Frame {
    let o = v.as_object().expect("a frame is an object");
    let (kind, value) = o.iter().next().expect("a frame has one member");
    match kind.as_str() {
        "int" => Frame::Int(value.as_i64().expect("an integer")),
        "bulk" => Frame::Bulk(bytes(value)),
        "simple" => Frame::Simple(text(value).to_string()),
        "null" => Frame::Null,
        "array" => Frame::Array(
            value
                .as_array()
                .unwrap()
                .iter()
                .map(frame_from_json)
                .collect(),
        ),
        other => panic!("unknown frame kind {other}"),
    }
}

fn headers_from(v: &Value) -> Vec<Header> {
    pairs(v)
        .into_iter()
        .map(|(name, value)| Header { name, value })
        .collect()
}

fn headers_to(headers: &[Header]) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|h| json!([to_bytes_value(&h.name), to_bytes_value(&h.value)]))
            .collect(),
    )
}

fn begin_reply_to_json(reply: &BeginReply) -> Value {
    match reply {
        BeginReply::New { token } => json!({ "new": { "token": token } }),
        BeginReply::InFlight { retry_after_ms } => {
            json!({ "in_flight": { "retry_after_ms": retry_after_ms } })
        }
        BeginReply::Replay(StoredResponse {
            status,
            body,
            headers,
        }) => json!({ "replay": {
            "status": status, "body": to_bytes_value(body), "headers": headers_to(headers),
        }}),
        BeginReply::Mismatch => json!({ "mismatch": {} }),
    }
}

fn render(write: impl FnOnce(&mut Recorder)) -> Frame {
    let mut recorder = Recorder::default();
    write(&mut recorder);
    let mut frames = recorder.into_frames();
    assert_eq!(frames.len(), 1);
    frames.pop().unwrap()
}

fn record_from(v: &Value) -> Record {
    let fingerprint: [u8; 32] = hex::decode(text(&v["fingerprint_hex"]))
        .unwrap()
        .try_into()
        .unwrap();
    let expires_at = match &v["expires_at"] {
        Value::Null => idem_core::record::NO_EXPIRY,
        at => uint(at),
    };
    let completed = |mirror| {
        State::Completed(Completed {
            status: uint(&v["status"]) as u16,
            body: bytes(&v["body"]),
            headers: headers_from(&v["headers"]),
            completed_at: uint(&v["completed_at"]),
            mirror,
        })
    };
    let state = match v.get("state").map(text) {
        Some("in_progress") => State::InProgress {
            lease_until: uint(&v["lease_until"]),
        },
        Some("completed") => completed(match text(&v["mirror"]) {
            "pending" => MirrorState::Pending,
            "mirrored" => MirrorState::Mirrored,
            other => panic!("mirror {other}"),
        }),
        // A pulled record: completed and pending.
        None => completed(MirrorState::Pending),
        Some(other) => panic!("state {other}"),
    };
    Record {
        fingerprint: Fingerprint::Digest(fingerprint),
        token: uint(&v["token"]),
        created_at: uint(&v["created_at"]),
        expires_at,
        state,
    }
}

#[test]
fn replies() {
    let mut file = SpecFile::open("vectors/replies.json");
    file.cases("begin", |case| {
        let outcome = case["outcome"].clone();
        let completed;
        let begin = if let Some(new) = outcome.get("new") {
            Begin::New {
                token: uint(&new["token"]),
            }
        } else if let Some(in_flight) = outcome.get("in_flight") {
            Begin::InFlight {
                retry_after_ms: uint(&in_flight["retry_after_ms"]),
            }
        } else if let Some(replay) = outcome.get("replay") {
            completed = Completed {
                status: uint(&replay["status"]) as u16,
                body: bytes(&replay["body"]),
                headers: headers_from(&replay["headers"]),
                completed_at: 1,
                mirror: MirrorState::Pending,
            };
            Begin::Replay(&completed)
        } else {
            assert!(outcome.get("mismatch").is_some(), "{outcome}");
            Begin::Mismatch
        };
        let mut filled = 0;
        for (field, layout) in [
            ("fields", ReplayLayout::Fields),
            ("packed", ReplayLayout::Packed),
        ] {
            let frame = render(|r| begin.write(r, layout));
            let parsed = BeginReply::parse(&frame).expect("the module's own reply");
            assert_eq!(begin_reply_to_json(&parsed), outcome, "{}", case["name"]);
            filled += expect(case, field, frame_to_json(&frame));
        }
        filled
    });
    file.cases("begin_equivalent", |case| {
        let parsed = BeginReply::parse(&frame_from_json(&case["reply"]))
            .unwrap_or_else(|e| panic!("{}: {e}", case["name"]));
        assert_eq!(
            begin_reply_to_json(&parsed),
            case["outcome"],
            "{}",
            case["name"]
        );
        0
    });
    file.cases("begin_invalid", |case| {
        let frame = frame_from_json(&case["reply"]);
        assert!(
            BeginReply::parse(&frame).is_err(),
            "{}: {frame:?}",
            case["name"]
        );
        assert!(BeginReply::parse_owned(frame).is_err(), "{}", case["name"]);
        0
    });
    file.cases("get", |case| {
        let record = match &case["record"] {
            Value::Null => None,
            v => Some(record_from(v)),
        };
        let frame = render(|r| write_record(r, record.as_ref()));
        assert_eq!(parse_record(&frame).expect("parses"), record);
        expect(case, "reply", frame_to_json(&frame))
    });
    file.cases("pull", |case| {
        let records: Vec<(Vec<u8>, Record)> = case["records"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| (bytes(&v["key"]), record_from(v)))
            .collect();
        let frame = render(|r| write_pull_batch(r, records.iter().map(|(k, r)| (&k[..], r))));
        let parsed = parse_pull_batch(&frame).expect("parses");
        assert_eq!(parsed.len(), records.len());
        for (got, (key, record)) in parsed.into_iter().zip(&records) {
            let got = got.expect("an entry");
            assert_eq!((&got.key, &got.record), (key, record));
        }
        expect(case, "reply", frame_to_json(&frame))
    });
    assert_eq!(file.doc["complete"]["reply"], json!({ "simple": "OK" }));
}

// ---------------------------------------------------------------- commands

fn args_json(args: Vec<Vec<u8>>) -> Value {
    Value::Array(args.iter().map(|a| to_bytes_value(a)).collect())
}

#[test]
fn commands() {
    let mut file = SpecFile::open("vectors/commands.json");
    file.cases("ttl_secs", |case| {
        let d = Duration::from_micros(uint(&case["us"]));
        expect(case, "secs", json!(args::ttl_secs(d)))
    });
    file.cases("client_ms", |case| {
        let d = Duration::from_micros(uint(&case["us"]));
        // `IdemClient`'s rule for LEASE, WAIT and TOUCH: rounded up, at least 1.
        expect(case, "ms", json!(args::duration_ms(d).max(1)))
    });
    file.cases("begin", |case| {
        let (key, fingerprint) = (bytes(&case["key"]), bytes(&case["fingerprint"]));
        let command = BeginArgs {
            key: &key,
            fingerprint: &fingerprint,
            ttl_secs: uint(&case["ttl_secs"]),
            lease_ms: case["lease_ms"].as_u64(),
            // A wait of zero is no wait (`IdemClient::begin`).
            wait_ms: case["wait_ms"].as_u64().filter(|&ms| ms > 0),
            replay: if case["packed"].as_bool().unwrap() {
                ReplayLayout::Packed
            } else {
                ReplayLayout::Fields
            },
        };
        let args = command.to_args();
        let refs: Vec<&[u8]> = args[1..].iter().map(Vec::as_slice).collect();
        let parsed = args::begin_args(&refs, &args::Limits::DEFAULT).expect("parses");
        assert_eq!(parsed, command);
        expect(case, "args", args_json(args))
    });
    file.cases("complete", |case| {
        let (key, body) = (bytes(&case["key"]), bytes(&case["body"]));
        let headers = pairs(&case["headers"]);
        let command = CompleteArgs {
            key: &key,
            token: uint(&case["token"]),
            status: uint(&case["status"]) as u16,
            body: &body,
            headers: headers.iter().map(|(n, v)| (&n[..], &v[..])),
            mirrored: case["mirrored"].as_bool().unwrap(),
        };
        expect(case, "args", args_json(command.to_args()))
    });
    file.cases("abort", |case| {
        let key = bytes(&case["key"]);
        let command = Abort(KeyToken {
            key: &key,
            token: uint(&case["token"]),
        });
        expect(case, "args", args_json(command.to_args()))
    });
    file.cases("touch", |case| {
        let key = bytes(&case["key"]);
        let command = Touch {
            key: &key,
            token: uint(&case["token"]),
            lease_ms: uint(&case["lease_ms"]),
        };
        expect(case, "args", args_json(command.to_args()))
    });
    file.cases("get", |case| {
        let args = vec![name::GET.as_bytes().to_vec(), bytes(&case["key"])];
        expect(case, "args", args_json(args))
    });
}

// ---------------------------------------------------------------- errors

fn server_error(code: &str, detail: &str) -> redis::RedisError {
    let wire = format!("-{code} {detail}\r\n");
    match redis::parse_redis_value(wire.as_bytes()).and_then(|v| v.extract_error()) {
        Err(err) => err,
        Ok(value) => panic!("{wire:?} parsed as a value: {value:?}"),
    }
}

fn codes(doc: &Value, field: &str) -> Vec<String> {
    doc[field]
        .as_array()
        .unwrap_or_else(|| panic!("no {field}"))
        .iter()
        .map(|c| text(c).to_string())
        .collect()
}

#[test]
fn error_codes() {
    let file = SpecFile::open("errors.json");
    let doc = &file.doc;
    let module: Vec<&str> = doc["module_codes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| text(&c["code"]))
        .collect();
    let all: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    assert_eq!(module, all, "every module code, in the module's order");
    for code in ErrorCode::ALL {
        let err = IdemError::from(server_error(code.as_str(), "detail"));
        assert_eq!(err.code(), Some(code), "{err:?}");
        let transient = codes(doc, "transient_codes").contains(&code.as_str().to_string());
        assert_eq!(err.is_transient(), transient, "{code}");
        assert!(!err.is_unavailable(), "{code}");
    }
    for code in codes(doc, "unavailable_codes") {
        let err = IdemError::from(server_error(&code, "not now"));
        assert!(
            err.is_unreachable() && err.is_unavailable(),
            "{code}: {err:?}"
        );
    }
    for code in codes(doc, "writes_refused_codes") {
        let err = IdemError::from(server_error(&code, "not now"));
        assert!(
            matches!(err, IdemError::WritesRefused(_)),
            "{code}: {err:?}"
        );
        assert!(err.is_unavailable() && !err.is_unreachable(), "{code}");
    }
    for code in codes(doc, "configuration_codes") {
        let err = IdemError::from(server_error(&code, "refused"));
        assert!(matches!(err, IdemError::Redis(_)), "{code}: {err:?}");
        assert!(!err.is_transient(), "{code}");
    }
    assert!(args::refuses_packed(text(&doc["packed_refused_detail"])));
}

// ---------------------------------------------------------------- HTTP

/// The problem object's canonical JSON: what the body must be byte for byte.
fn problem_body(spec: &Value, detail: &str) -> String {
    let object = json!({
        "type": spec["type"], "title": spec["title"], "status": spec["status"], "detail": detail,
    });
    String::from_utf8(canonicalize(object.to_string().as_bytes()).unwrap()).unwrap()
}

async fn answer(problem: Problem) -> (StatusCode, HeaderMap, String) {
    let response = problem.into_response::<Body>();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(Body::new(body), usize::MAX)
        .await
        .unwrap();
    (
        parts.status,
        parts.headers,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

#[tokio::test]
async fn problems() {
    let file = SpecFile::open("http.json");
    let doc = &file.doc;
    let problem_type = text(&doc["headers"]["problem_content_type"]);
    let problems = &doc["problems"];
    let cases = [
        ("missing_key", Problem::MissingKey),
        (
            "invalid_key",
            Problem::InvalidKey(KeyError::Malformed.detail()),
        ),
        ("request_too_large", Problem::RequestTooLarge),
        ("unreadable_request", Problem::UnreadableRequest),
        (
            "in_flight",
            Problem::InFlight {
                retry_after: Duration::from_millis(1500),
            },
        ),
        ("mismatch", Problem::Mismatch),
        ("missing_tenant", Problem::MissingTenant),
        ("invalid_tenant", Problem::InvalidTenant),
        ("unavailable", Problem::Unavailable),
        ("internal", Problem::Internal),
    ];
    assert_eq!(problems.as_object().unwrap().len(), cases.len());
    for (name, problem) in cases {
        let spec = &problems[name];
        let (status, headers, body) = answer(problem).await;
        assert_eq!(u64::from(status.as_u16()), uint(&spec["status"]), "{name}");
        assert_eq!(headers["content-type"], problem_type, "{name}");
        let detail = match &spec["detail"] {
            Value::Null => KeyError::Malformed.detail(),
            detail => text(detail),
        };
        assert_eq!(body, problem_body(spec, detail), "{name}");
        let retry_after = headers.get("retry-after").map(|v| v.to_str().unwrap());
        match name {
            "in_flight" => assert_eq!(retry_after, Some("2")),
            _ => assert_eq!(retry_after, spec.get("retry_after").map(text), "{name}"),
        }
    }
    for case in doc["in_flight_retry_after"]["cases"].as_array().unwrap() {
        let retry_after = Duration::from_millis(uint(&case["retry_after_ms"]));
        let (_, headers, _) = answer(Problem::InFlight { retry_after }).await;
        assert_eq!(headers["retry-after"], text(&case["header"]), "{case}");
    }
    let key_errors = &doc["key_errors"];
    for err in [
        KeyError::Empty,
        KeyError::TooLong,
        KeyError::Malformed,
        KeyError::Repeated,
    ] {
        assert_eq!(err.detail(), text(&key_errors[key_error_kind(&err)]));
    }
    assert_eq!(
        IDEMPOTENT_REPLAYED.as_str(),
        text(&doc["headers"]["replayed"])
    );
    for status in 100..=599u16 {
        let status = StatusCode::from_u16(status).unwrap();
        let stored = !(status.is_server_error() || status.as_u16() == 429);
        assert_eq!(default_store_policy(status), stored, "{status}");
    }
    let defaults = &doc["defaults"];
    assert_eq!(
        uint(&defaults["max_tenant_bytes"]) as usize,
        MAX_TENANT_BYTES
    );
    assert_eq!(
        DEFAULT_CALL_TIMEOUT,
        Duration::from_millis(uint(&defaults["call_timeout_ms"]))
    );
    assert_eq!(
        DEFAULT_LOOKUP_TIMEOUT,
        Duration::from_millis(uint(&defaults["read_through_timeout_ms"]))
    );
}

/// The layer's defaults and answers, seen from outside: methods, key header,
/// prefix, TTL, lease, stored headers, the replay marker, key errors.
#[tokio::test(start_paused = true)]
async fn the_layer_answers_as_the_spec_says() {
    let file = SpecFile::open("http.json");
    let doc = &file.doc;
    let defaults = &doc["defaults"];
    let store = MemoryStore::new();
    let app = layered(IdempotencyLayer::new(IdemClient::memory(store.clone())));
    let header = text(&defaults["header"]);
    let prefix = text(&defaults["key_prefix"]);
    let request = |method: &str, key: &str| {
        Request::builder()
            .method(method)
            .uri("/p")
            .header(header, key)
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .unwrap()
    };

    let methods: Vec<&str> = defaults["methods"]
        .as_array()
        .unwrap()
        .iter()
        .map(text)
        .collect();
    assert_eq!(methods, ["POST", "PATCH"]);
    // PUT is not covered: it passes through and leaves no record.
    let (status, _, _) = call(&app, request("PUT", "k-put")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(get_record(&store, &redis_key(prefix, "", "k-put"))
        .await
        .is_none());

    // A new key: the handler runs; the record has the default TTL.
    let (status, headers, _) = call(&app, request("POST", "k")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get(IDEMPOTENT_REPLAYED).is_none());
    let record = get_record(&store, &redis_key(prefix, "", "k"))
        .await
        .expect("stored under prefix{tenant:key}");
    assert_eq!(
        record.expires_at - record.created_at,
        uint(&defaults["ttl_ms"])
    );
    // The replay: stored headers only, and the marker.
    let (status, headers, body) = call(&app, request("POST", "k")).await;
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"{}"[..]));
    assert_eq!(
        headers[text(&doc["headers"]["replayed"])],
        text(&doc["headers"]["replayed_value"])
    );
    let mut names: Vec<&str> = headers
        .keys()
        .map(HeaderName::as_str)
        .filter(|name| *name != "content-length")
        .collect();
    names.sort_unstable();
    let mut expected: Vec<&str> = defaults["stored_headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(text)
        .collect();
    expected.push(text(&doc["headers"]["replayed"]));
    expected.sort_unstable();
    assert_eq!(names, expected);

    // A key in flight: its lease is the default one.
    let slow = Router::new()
        .route(
            "/p",
            post(|| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                StatusCode::CREATED
            }),
        )
        .layer(IdempotencyLayer::new(IdemClient::memory(store.clone())));
    let running = tokio::spawn({
        let (slow, original) = (slow.clone(), request("POST", "slow"));
        async move { call(&slow, original).await }
    });
    tokio::time::sleep(Duration::from_millis(1)).await;
    let record = get_record(&store, &redis_key(prefix, "", "slow"))
        .await
        .expect("in progress");
    let State::InProgress { lease_until } = record.state else {
        panic!("not in progress: {record:?}")
    };
    let lease = lease_until - record.created_at;
    assert!(
        lease.abs_diff(uint(&defaults["lease_ms"])) <= 1,
        "lease {lease}"
    );
    let (status, headers, _) = call(&slow, request("POST", "slow")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let capped = uint(&defaults["max_retry_after_ms"]).div_ceil(1000);
    assert_eq!(headers["retry-after"], capped.to_string().as_str());
    running.abort();

    // The same key sent twice is refused with the spec's detail.
    let repeated = Request::post("/p")
        .header(header, "a")
        .header(header, "b")
        .body(Body::from("{}"))
        .unwrap();
    let (status, _, body) = call(&app, repeated).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["detail"], doc["key_errors"]["repeated"]);
}

// ---------------------------------------------------------------- read-through

/// The value of `const NAME: &str = "...";` in Rust source, as the compiler
/// reads it (a backslash before a line break drops the break and the next
/// line's leading whitespace; `\'` and `\"` are the characters).
fn rust_str_const(source: &str, name: &str) -> String {
    let start = source
        .find(&format!("const {name}: &str = \""))
        .unwrap_or_else(|| panic!("no const {name}"));
    let rest = &source[start..];
    let rest = &rest[rest.find('"').unwrap() + 1..];
    let mut out = String::new();
    let mut chars = rest.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => return out,
            '\\' => match chars.next() {
                Some('\n') => {
                    while chars.peek().is_some_and(|c| c.is_whitespace()) {
                        chars.next();
                    }
                }
                Some('n') => out.push('\n'),
                Some(other) => out.push(other),
                None => break,
            },
            c => out.push(c),
        }
    }
    panic!("const {name} is not closed")
}

#[test]
fn read_through_matches_the_rust_lookup() {
    let file = SpecFile::open("read_through.json");
    let source = include_str!("../src/read_through.rs");
    assert_eq!(
        rust_str_const(source, "LOOKUP"),
        text(&file.doc["lookup_sql"])
    );
    assert_eq!(
        DEFAULT_LOOKUP_TIMEOUT,
        Duration::from_millis(uint(&file.doc["timeout_ms"]))
    );
}

// ---------------------------------------------------------------- the fence

#[test]
fn fence_statements_are_the_rust_constants() {
    use idem_client::fence;
    let file = SpecFile::open("fence.json");
    let statements = file.doc["statements"].as_object().expect("statements");
    let constants = [
        ("CLAIM_SQL", fence::CLAIM_SQL),
        ("PARTITIONED_GATE_SQL", fence::PARTITIONED_GATE_SQL),
        ("PARTITIONED_CLAIM_SQL", fence::PARTITIONED_CLAIM_SQL),
        ("ROW_SQL", fence::ROW_SQL),
        ("COMPLETE_SQL", fence::COMPLETE_SQL),
        ("COMPLETE_WITH_EFFECT_SQL", fence::COMPLETE_WITH_EFFECT_SQL),
        ("RENEW_SQL", fence::RENEW_SQL),
        ("RELEASE_SQL", fence::RELEASE_SQL),
    ];
    assert_eq!(statements.len(), constants.len(), "one entry per constant");
    assert_eq!(
        text(&file.doc["not_held"]["message_contains"]),
        fence::NOT_HELD_MESSAGE
    );
    assert_eq!(text(&file.doc["not_held"]["sqlstate"]), "22P02");
    assert_eq!(
        text(&file.doc["moved"]["sqlstate"]),
        tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE.code()
    );
    assert!(fence::COMPLETE_SQL.contains(fence::NOT_HELD_MESSAGE));
    assert!(fence::COMPLETE_WITH_EFFECT_SQL.contains(fence::NOT_HELD_MESSAGE));
    let with_effect = &file.doc["statements"]["complete_with_effect"];
    assert_eq!(
        uint(&with_effect["effect_first_param"]),
        fence::EFFECT_FIRST_PARAM as u64
    );
    let placeholder = text(&with_effect["effect_placeholder"]);
    assert_eq!(
        fence::COMPLETE_WITH_EFFECT_SQL.matches(placeholder).count(),
        1
    );
    let seed = format!("hashtextextended($1, {})", uint(&file.doc["lock_seed"]));
    for (name, statement) in statements {
        let rust = text(&statement["rust"]);
        let (_, constant) = constants
            .iter()
            .find(|(n, _)| *n == rust)
            .unwrap_or_else(|| panic!("{name}: no constant {rust}"));
        assert_eq!(text(&statement["sql"]), *constant, "{name} ({rust})");
        let params = statement["params"].as_array().expect("params").len();
        let highest = (1..=9)
            .filter(|n| constant.contains(&format!("${n}")))
            .max()
            .unwrap_or(0);
        assert_eq!(params, highest, "{name}: params");
        if constant.contains("hashtextextended") {
            assert!(constant.contains(&seed), "{name}: the lock seed");
        }
    }
}

// ---------------------------------------------------------- the Functions library

#[test]
fn functions_contract_is_the_rust_constants() {
    use idem_core::functions as f;
    let file = SpecFile::open("functions.json");
    let doc = &file.doc;
    assert_eq!(text(&doc["library"]), f::LIBRARY);
    assert_eq!(uint(&doc["version"]), f::VERSION);
    let names = [
        ("begin", f::BEGIN),
        ("complete", f::COMPLETE),
        ("abort", f::ABORT),
        ("touch", f::TOUCH),
        ("get", f::GET),
        ("mirror_claim", f::MIRROR_CLAIM),
        ("mirror_ack", f::MIRROR_ACK),
        ("version", f::VERSION_FN),
    ];
    let functions = doc["functions"].as_object().expect("functions");
    assert_eq!(functions.len(), names.len(), "one entry per constant");
    for (entry, constant) in names {
        assert_eq!(text(&functions[entry]["name"]), constant, "{entry}");
    }

    let slots = SpecFile::open("outbox_slots.json");
    assert_eq!(text(&slots.doc["prefix"]), f::OUTBOX_PREFIX);
    assert_eq!(text(&slots.doc["suffix"]), f::OUTBOX_SUFFIX);
    let tags = slots.doc["tags"].as_array().expect("tags");
    assert_eq!(tags.len(), usize::from(f::SLOTS));
    for (slot, tag) in (0..f::SLOTS).zip(tags) {
        assert_eq!(text(tag), f::outbox_tag(slot).to_string(), "slot {slot}");
    }
}
