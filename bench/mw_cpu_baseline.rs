//! `mw_cpu` (crates/idem-client/examples/mw_cpu.rs) as the code issue 12
//! measured could run it: its `bare`, `new` and `replay` modes, written
//! against idem-client at commit 6b1b6e3 (2026-11-30: redis-rs'
//! `ConnectionManager`, no `Pipe`). `scripts/bench-http.sh` builds it in a
//! worktree of that commit, so the layer before and after is measured in
//! one run on one machine. Not built in this workspace.
//!
//! MW_MODE: bare (the handler alone), new (a fresh key per request), replay
//! (one key). MW_REQUESTS (20000), MW_CONCURRENCY (32), MW_THREADS (0: a
//! current-thread runtime, which callgrind counts repeatably; else that many
//! workers), MW_BODY (canonical JSON; `unsorted`: the same members in
//! another order).

use std::time::Instant;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idem_client::middleware::IdemBody;
use idem_client::{IdemClient, IdempotencyLayer};
use idem_testkit::RedisConfig;
use tower::{Layer, Service, ServiceExt};

/// The request body: canonical JSON (members sorted, compact), or with
/// MW_BODY=unsorted the same members in another order, so canonicalization
/// takes its full way.
fn request_body() -> &'static str {
    static BODY: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    BODY.get_or_init(|| match std::env::var("MW_BODY").as_deref() {
        Ok("unsorted") => r#"{"recipient":"acct_bench","amount":1250,"currency":"EUR"}"#,
        _ => r#"{"amount":1250,"currency":"EUR","recipient":"acct_bench"}"#,
    })
}

/// CPU seconds of all threads of this process (schedstat, ns precision).
fn cpu_seconds() -> f64 {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = task.unwrap().path().join("schedstat");
        if let Ok(text) = std::fs::read_to_string(path) {
            ns += text
                .split_whitespace()
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap();
        }
    }
    ns as f64 / 1e9
}

async fn handler<B>(request: Request<B>) -> Result<Response<Full<Bytes>>, std::convert::Infallible>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let body = request.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), request_body().len());
    let mut response = Response::new(Full::new(Bytes::from_static(
        br#"{"id":"pay_0123456789","amount":1250,"currency":"EUR","recipient":"acct_bench","status":"created"}"#,
    )));
    *response.status_mut() = StatusCode::CREATED;
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    response.headers_mut().insert(
        "location",
        HeaderValue::from_static("/payments/pay_0123456789"),
    );
    Ok(response)
}

fn request(key: Option<String>) -> Request<Full<Bytes>> {
    let mut builder = Request::post("/payments")
        .header("content-type", "application/json")
        .header("x-account-id", "acct_bench")
        .header("host", "127.0.0.1:1234")
        .header("user-agent", "bench");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .body(Full::new(Bytes::from_static(request_body().as_bytes())))
        .unwrap()
}

fn main() {
    let mode = std::env::var("MW_MODE").unwrap_or_else(|_| "new".into());
    let total: usize = std::env::var("MW_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20000);
    let concurrency: usize = std::env::var("MW_CONCURRENCY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32);
    let redis = RedisConfig::default().start();
    let threads: usize = std::env::var("MW_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let runtime = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .unwrap()
    };
    runtime.block_on(async move {
        let client = IdemClient::standalone(redis.client()).await.unwrap();
        let layer = IdempotencyLayer::new(client)
            .tenant_header(http::HeaderName::from_static("x-account-id"));
        let service = layer.layer(tower::service_fn(handler::<IdemBody<Full<Bytes>>>));
        let bare = tower::service_fn(handler::<Full<Bytes>>);
        // Seed the replay key and warm up.
        let seeded = service
            .clone()
            .oneshot(request(Some("replay-key".into())))
            .await
            .unwrap();
        assert_eq!(seeded.status(), StatusCode::CREATED);
        let run = |count: usize, offset: usize| {
            let service = service.clone();
            let mode = mode.clone();
            async move {
                let mut next = 0;
                let mut running = FuturesUnordered::new();
                let mut done = 0;
                while done < count {
                    while next < count && running.len() < concurrency {
                        let i = offset + next;
                        next += 1;
                        let mut service = service.clone();
                        let mut bare = bare;
                        let mode = mode.clone();
                        running.push(tokio::spawn(async move {
                            let (status, body) = match mode.as_str() {
                                "bare" => {
                                    let r = bare.call(request(None)).await.unwrap();
                                    (
                                        r.status(),
                                        r.into_body().collect().await.unwrap().to_bytes(),
                                    )
                                }
                                "replay" => {
                                    let r = service
                                        .call(request(Some("replay-key".into())))
                                        .await
                                        .unwrap();
                                    (
                                        r.status(),
                                        r.into_body().collect().await.unwrap().to_bytes(),
                                    )
                                }
                                _ => {
                                    let r = service
                                        .call(request(Some(format!("k-{i}"))))
                                        .await
                                        .unwrap();
                                    (
                                        r.status(),
                                        r.into_body().collect().await.unwrap().to_bytes(),
                                    )
                                }
                            };
                            assert_eq!(status, StatusCode::CREATED);
                            body.len()
                        }));
                    }
                    running.next().await;
                    done += 1;
                }
            }
        };
        run(2000, 0).await;
        let cpu = cpu_seconds();
        let started = Instant::now();
        run(total, 1_000_000).await;
        let cpu = cpu_seconds() - cpu;
        println!(
            "mode {mode}: {total} requests, {:.1} us CPU/request, {:.0} req/s",
            cpu / total as f64 * 1e6,
            total as f64 / started.elapsed().as_secs_f64()
        );
    });
}
