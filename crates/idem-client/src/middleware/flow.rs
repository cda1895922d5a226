//! The idempotency flow for one request that carries a key: buffer and
//! fingerprint the request, BEGIN, then answer 409/422/replay, or run the
//! handler (in the request's task; when the client hangs up first, the rest
//! moves into a task of its own, so it is never cut short: `Detaching`),
//! keep the lease alive meanwhile, and settle the key (see `store`). The
//! handler finds a `Fence` in its request extensions; when it used it, the
//! fence's report decides what Redis keeps.
//!
//! Every request's flow is one allocation the size of its largest state, so
//! paths most requests never take (fail-open, the fence's settling, lease
//! renewal, answering again) await boxed futures of their own.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use http::{response, Request, Response};
use http_body::Body;
use redis::aio::ConnectionLike;
use tokio::time::Instant;
use tower::{Service, ServiceExt};

use super::begin::{begin_request, FENCE_RETRY_AFTER};
use super::body::{collect_limited, BoxError, Collected, IdemBody};
use super::config::{Config, RequestFence};
use super::key::{check_tenant, redis_key, TenantError};
use super::metrics::{FenceAnswer, Observer, Outcome as Counted, RedisOp};
use super::problem::{replay_response, Problem};
use super::store::Held;
use crate::fence::{Claim, FenceReport};
use crate::{Fingerprint, IdemError, Outcome};

pub(crate) async fn handle<S, C, ReqBody, ResBody>(
    config: Arc<Config<C>>,
    inner: S,
    request: Request<ReqBody>,
    key: String,
) -> Result<Response<IdemBody<ResBody>>, S::Error>
where
    S: Service<Request<IdemBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let observer = config.observer(request.extensions());
    // In a block of its own: what it leaves behind takes no room in the
    // flow's later states.
    let (request, key, fingerprint) = {
        let (parts, body) = request.into_parts();
        let body = match collect_limited(body, config.max_request_body).await {
            Ok(Collected::Complete(body)) => body,
            Ok(Collected::Overflow { .. }) => {
                observer.outcome(Counted::BadBody);
                return Ok(Problem::RequestTooLarge.into_response());
            }
            Err(err) => {
                observer.outcome(Counted::BadBody);
                tracing::debug!(error = %err, "request body could not be read");
                return Ok(Problem::UnreadableRequest.into_response());
            }
        };
        // No tenant source: the one anonymous scope. With one, no tenant is
        // a 400, never the anonymous scope.
        let tenant = match config
            .tenant
            .as_ref()
            .map(|tenant| check_tenant(tenant(&parts)))
        {
            None => String::new(),
            Some(Ok(tenant)) => tenant,
            Some(Err(err)) => {
                observer.outcome(Counted::BadKey);
                return Ok(match err {
                    TenantError::Missing => Problem::MissingTenant,
                    TenantError::TooLong => Problem::InvalidTenant,
                }
                .into_response());
            }
        };
        let key = redis_key(&config.key_prefix, &tenant, &key);
        let fingerprint =
            config
                .fingerprinter
                .fingerprint(&parts.method, &parts.uri, &parts.headers, &body);
        let request = Request::from_parts(parts, IdemBody::full(body));
        (request, key, fingerprint)
    };

    let started = Instant::now();
    let begun = begin_request(&config, &key, &fingerprint, &observer).await;
    observer.begin(started.elapsed());
    if let Err(err) = &begun {
        observer.redis_error(RedisOp::Begin, err);
    }
    match begun {
        Ok((Outcome::New { token }, fence)) => {
            observer.outcome(Counted::New);
            let fence = fence.unwrap_or_else(|| config.request_fence(&key, token, &fingerprint));
            run_new(
                config,
                inner,
                request,
                key,
                token,
                fingerprint,
                fence,
                observer,
            )
            .await
        }
        Ok((Outcome::InFlight { retry_after }, _)) => {
            observer.outcome(Counted::InFlight);
            let retry_after = retry_after.min(config.max_retry_after);
            Ok(Problem::InFlight { retry_after }.into_response())
        }
        Ok((Outcome::Replay(stored), _)) => {
            observer.outcome(Counted::Replay);
            Ok(replay_response(stored))
        }
        Ok((Outcome::Mismatch, _)) => {
            observer.outcome(Counted::Mismatch);
            Ok(Problem::Mismatch.into_response())
        }
        Err(err) if config.fails_open_on(&err) => {
            observer.outcome(Counted::FailOpen);
            tracing::warn!(error = %err, "idempotency store unavailable; running the request unprotected (fail-open)");
            let response = Box::pin(inner.oneshot(request)).await?;
            Ok(response.map(IdemBody::inner))
        }
        Err(err) if err.is_transient() => {
            observer.outcome(Counted::Unavailable);
            tracing::warn!(error = %err, "idempotency store unavailable; answering 503");
            Ok(Problem::Unavailable.into_response())
        }
        Err(err) => {
            observer.outcome(Counted::Error);
            tracing::error!(error = %err, "IDEM.BEGIN failed");
            Ok(Problem::Internal.into_response())
        }
    }
}

/// Runs the handler with `fence` and settles the key. A panic in the
/// handler releases the key (and a durable claim its fence made through a
/// pool) and is passed on.
#[allow(clippy::too_many_arguments)] // the request's parts, each moved in once
async fn run_new<S, C, ReqBody, ResBody>(
    config: Arc<Config<C>>,
    inner: S,
    request: Request<IdemBody<ReqBody>>,
    key: String,
    token: u64,
    fingerprint: Fingerprint,
    fence: RequestFence,
    observer: Observer,
) -> Result<Response<IdemBody<ResBody>>, S::Error>
where
    S: Service<Request<IdemBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let held = Held {
        config: &config,
        key: &key,
        token,
        fingerprint: &fingerprint,
        observer: &observer,
        answering: true,
    };
    let outcome = AssertUnwindSafe(execute(&held, &fence, inner, request))
        .catch_unwind()
        .await;
    match outcome {
        Ok(result) => result,
        Err(panic) => {
            fence.take_report().release_claim(&key, token).await;
            held.release().await;
            std::panic::resume_unwind(panic)
        }
    }
}

/// The flow of one request, boxed once: dropped before it finished (the
/// client hung up, an outer timeout), it is spawned to finish on its own, on
/// the runtime it is dropped in, so a request that arrived whole is decided,
/// run and settled as if its client had waited. Outside any runtime it is
/// dropped: a key it holds then frees itself when its lease lapses.
pub(crate) struct Detaching<T> {
    future: Option<BoxFuture<'static, T>>,
    /// `spawn::<T>`, taken where `T: 'static` is known (the struct and its
    /// `Drop` carry no bounds, so neither does `ResponseFuture`).
    spawn: fn(BoxFuture<'static, T>),
}

impl<T: 'static> Detaching<T> {
    pub(crate) fn new(future: BoxFuture<'static, T>) -> Self {
        Detaching {
            future: Some(future),
            spawn: spawn::<T>,
        }
    }
}

fn spawn<T: 'static>(future: BoxFuture<'static, T>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        drop(runtime.spawn(async move {
            future.await;
        }));
    }
}

impl<T> Future for Detaching<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let future = self
            .future
            .as_mut()
            .expect("Detaching polled after completion");
        // A flow whose poll panicked is over: dropped, not detached (its
        // key was settled on the way out, or lapses with its lease).
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        let output = match polled {
            Ok(poll) => std::task::ready!(poll),
            Err(panic) => {
                self.future = None;
                std::panic::resume_unwind(panic)
            }
        };
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T> Drop for Detaching<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            (self.spawn)(future);
        }
    }
}

async fn execute<S, C, ReqBody, ResBody>(
    held: &Held<'_, C>,
    fence: &RequestFence,
    inner: S,
    mut request: Request<IdemBody<ReqBody>>,
) -> Result<Response<IdemBody<ResBody>>, S::Error>
where
    S: Service<Request<IdemBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let (config, key) = (held.config, held.key);
    fence.attach(request.extensions_mut());
    let limit = config.max_response_body;
    // Pinned here and lent to `keep_lease`: moved in, it would be stored
    // twice in the flow's state (as the argument and as its pinned local).
    let work = std::pin::pin!(async move {
        let response = inner.oneshot(request).await?;
        let (parts, body) = response.into_parts();
        Ok((parts, collect_limited(body, limit).await))
    });
    let outcome = keep_lease(config, key, held.token, held.observer, work).await;
    let mut report = fence.take_report();
    let (parts, collected) = match outcome {
        Ok(done) => done,
        Err(err) => {
            Box::pin(settle_fence::<C, ResBody>(held, report)).await;
            return Err(err);
        }
    };
    if let FenceReport::ClaimedUpFront(release, _) = report {
        // The handler did not use the claim the layer made for it: give it
        // up, then store the handler's response as any other.
        release.run(key, held.token).await;
        report = FenceReport::Unused;
    }
    if !matches!(report, FenceReport::Unused) {
        if let Some(answer) = Box::pin(settle_fence(held, report)).await {
            return Ok(answer);
        }
        return Ok(respond(key, parts, collected));
    }
    match &collected {
        Ok(Collected::Complete(body)) if (config.store_policy)(parts.status) => {
            let stored = held.stored(&parts, body);
            if let Some(answer) = held.store(&stored).await {
                return Ok(answer);
            }
        }
        Ok(Collected::Overflow { .. }) => {
            tracing::warn!(
                key,
                limit,
                "response larger than max_response_body: sent but not stored, key released"
            );
            held.release().await;
        }
        _ => held.release().await,
    }
    Ok(respond(key, parts, collected))
}

/// Settles a key whose handler used the fence; `Some` when the client gets
/// the fence's answer instead of the handler's response.
async fn settle_fence<C, B>(
    held: &Held<'_, C>,
    report: FenceReport,
) -> Option<Response<IdemBody<B>>>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let observer = held.observer;
    match report {
        FenceReport::Committed(stored) => {
            observer.fence(FenceAnswer::Committed);
            held.store_committed(&stored).await
        }
        FenceReport::Decided(Claim::Replay(stored)) => {
            observer.fence(FenceAnswer::Replay);
            held.refill(&stored).await;
            Some(replay_response(stored))
        }
        FenceReport::Decided(Claim::InFlight) => {
            observer.fence(FenceAnswer::InFlight);
            held.release().await;
            let retry_after = FENCE_RETRY_AFTER.min(held.config.max_retry_after);
            Some(Problem::InFlight { retry_after }.into_response())
        }
        FenceReport::Decided(Claim::Mismatch) => {
            observer.fence(FenceAnswer::Mismatch);
            held.release().await;
            Some(Problem::Mismatch.into_response())
        }
        // Claimed but not committed through the fence (rolled back, failed,
        // fate unknown): the effect did not happen or a retry's claim finds
        // it. A durable claim is given up first, so the retry Redis lets in
        // next proceeds at once.
        FenceReport::Claimed(release) | FenceReport::ClaimedUpFront(release, _) => {
            observer.fence(FenceAnswer::Released);
            release.run(held.key, held.token).await;
            held.release().await;
            None
        }
        FenceReport::Decided(Claim::Proceed) | FenceReport::Unused => {
            held.release().await;
            None
        }
    }
}

/// The handler's response as it goes out: whole, resumed after the buffered
/// prefix, or a 500 problem when its body failed (the key is settled already).
fn respond<B>(
    key: &str,
    parts: response::Parts,
    collected: Result<Collected<B>, BoxError>,
) -> Response<IdemBody<B>> {
    match collected {
        Ok(Collected::Complete(body)) => Response::from_parts(parts, IdemBody::full(body)),
        Ok(Collected::Overflow { prefix, rest }) => {
            Response::from_parts(parts, IdemBody::resumed(prefix, rest))
        }
        Err(err) => {
            tracing::warn!(key, error = %err, "response body failed");
            Problem::Internal.into_response()
        }
    }
}

/// Awaits `work` while renewing the lease every third of it. Renewal stops
/// for good when the module says the key is no longer ours. The timer is
/// armed only when `work` does not finish at once.
async fn keep_lease<C, F: Future>(
    config: &Config<C>,
    key: &str,
    token: u64,
    observer: &Observer,
    mut work: Pin<&mut F>,
) -> F::Output
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let lease = config.lease;
    let every = (lease / 3).max(Duration::from_millis(10));
    let renew = async {
        let next = tokio::time::sleep(every);
        tokio::pin!(next);
        loop {
            next.as_mut().await;
            let touched = Box::pin(config.client.touch(key, token, lease)).await;
            if let Err(err) = &touched {
                observer.redis_error(RedisOp::Touch, err);
            }
            match touched {
                Ok(_) => {}
                Err(
                    err @ (IdemError::Stale(_) | IdemError::NotFound(_) | IdemError::Completed(_)),
                ) => {
                    tracing::warn!(key, error = %err, "lease lost while the handler runs");
                    return;
                }
                Err(err) => tracing::warn!(key, error = %err, "lease renewal failed; retrying"),
            }
            // One renewal per `every`; a late one does not bring the next forward.
            let now = Instant::now();
            let due = next.deadline() + every;
            next.as_mut()
                .reset(if due > now { due } else { now + every });
        }
    };
    tokio::select! {
        biased;
        output = work.as_mut() => output,
        () = renew => work.await,
    }
}
