//! `Idempotency`, the tower `Service` the layer produces, and its
//! `ResponseFuture`. Requests the layer does not apply to go straight to the
//! inner service (unboxed); the others run the idempotency flow.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use redis::aio::ConnectionLike;
use tower::Service;

use super::body::{BoxError, IdemBody};
use super::config::Config;
use super::flow;
use super::key::parse_key;
use super::metrics::Outcome;
use super::problem::Problem;

/// The middleware around an inner service `S`, made by
/// [`IdempotencyLayer`](super::IdempotencyLayer); `C` is the client's
/// connection type.
pub struct Idempotency<S, C> {
    inner: S,
    config: Arc<Config<C>>,
}

impl<S: Clone, C> Clone for Idempotency<S, C> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S, C> Idempotency<S, C> {
    pub(crate) fn new(inner: S, config: Arc<Config<C>>) -> Self {
        Idempotency { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably. A request already handed on keeps the
    /// clone of the inner service it was given.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, without the middleware.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, C, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, C>
where
    S: Service<Request<IdemBody<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    type Response = Response<IdemBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = &self.config;
        if !config.methods.contains(request.method()) {
            return ResponseFuture::passthrough(self.inner.call(request.map(IdemBody::inner)));
        }
        let key = match parse_key(request.headers().get_all(&config.header).iter()) {
            Ok(Some(key)) => key,
            Ok(None) if config.required => {
                bad_key(config, &request);
                return ResponseFuture::ready(Problem::MissingKey);
            }
            Ok(None) => {
                return ResponseFuture::passthrough(self.inner.call(request.map(IdemBody::inner)))
            }
            Err(err) => {
                bad_key(config, &request);
                return ResponseFuture::ready(Problem::InvalidKey(err.detail()));
            }
        };
        // The ready service goes into the flow; a clone stays for the next call.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        // Written straight into its box: `Box::pin(handle(..))` built the
        // future (its largest state's size) on the stack and copied it in.
        let slot = Box::new_uninit();
        let future = Box::write(slot, flow::handle(config.clone(), inner, request, key));
        ResponseFuture::flow(flow::Detaching::new(Box::into_pin(future)))
    }
}

/// Counts a request answered 400 for its key header.
fn bad_key<C, B>(config: &Config<C>, request: &Request<B>) {
    config
        .observer(request.extensions())
        .outcome(Outcome::BadKey);
}

pin_project! {
    /// Response future of `Idempotency`.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] future: F },
        Ready { response: Option<Response<IdemBody<B>>> },
        Flow { future: flow::Detaching<Result<Response<IdemBody<B>>, E>> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    fn passthrough(future: F) -> Self {
        ResponseFuture {
            kind: Kind::Passthrough { future },
        }
    }

    fn ready(problem: Problem) -> Self {
        ResponseFuture {
            kind: Kind::Ready {
                response: Some(problem.into_response()),
            },
        }
    }

    fn flow(future: flow::Detaching<Result<Response<IdemBody<B>>, E>>) -> Self {
        ResponseFuture {
            kind: Kind::Flow { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<IdemBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => future
                .poll(cx)
                .map(|result| result.map(|response| response.map(IdemBody::inner))),
            KindProj::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
            KindProj::Flow { future } => Pin::new(future).poll(cx),
        }
    }
}
