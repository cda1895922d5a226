//! How a finished request leaves its key in Redis: COMPLETE (the handler's
//! response, or a response the fence committed to Postgres, `MIRRORED`) or
//! ABORT, and what the client is answered when the key was lost (`NOTFOUND`)
//! or taken over (`STALE`) meanwhile: one answer per key, stored. With the
//! layer's `replica_ack`, the COMPLETE of an answer goes out with a replica
//! `WAIT`, and an answer not acknowledged by enough replicas (or not stored
//! for now) is a 503 instead; the key is never released for it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{response, HeaderMap, HeaderName, Response};
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use super::begin::begin;
use super::body::IdemBody;
use super::config::{Config, ReplicaAck};
use super::metrics::{AckFailure, Observer, RedisOp};
use super::problem::{replay_response, Problem};
use crate::outcome::ResponseParts;
use crate::{Fingerprint, IdemError, Origin, Outcome, StoredResponse};

/// How long a COMPLETE failing because Redis is unreachable is retried
/// before the response is sent (the rest goes on in the background, up to
/// the layer's `store_retry`).
const STORE_AT_ONCE: Duration = Duration::from_millis(150);
/// Pauses between attempts: the first, doubling up to the longest.
const PAUSE_FIRST: Duration = Duration::from_millis(50);
const PAUSE_MAX: Duration = Duration::from_millis(500);
/// What a `store_retry` beyond the clock's range stands for.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The key a request holds in Redis.
pub(crate) struct Held<'a, C> {
    pub config: &'a Arc<Config<C>>,
    pub key: &'a str,
    pub token: u64,
    pub fingerprint: &'a Fingerprint,
    /// The request's metrics.
    pub observer: &'a Observer,
    /// Whether a client awaits this key's answer: false for a store retried
    /// in the background, whose client has its answer already (no replica
    /// ack is waited for or counted there).
    pub answering: bool,
}

/// What the client gets when the key's answer is not the handler's own.
pub(crate) type Override<B> = Option<Response<IdemBody<B>>>;

/// How far a stored answer got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    /// Stored, and acknowledged by the replicas `replica_ack` asks for
    /// (when it does).
    Durable,
    /// Stored on the primary, but fewer replicas than `replica_ack` asks
    /// for acknowledged it in time (or `WAIT` failed): a failover may lose
    /// it.
    Unacknowledged,
}

impl<C> Held<'_, C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The response the middleware stores for `parts` and `body`, read in
    /// place.
    pub fn stored<'r>(&'r self, parts: &'r response::Parts, body: &'r Bytes) -> Handled<'r> {
        Handled {
            parts,
            body,
            names: &self.config.stored_headers,
        }
    }

    /// Stores the handler's response (not fenced). When the key was taken
    /// over or lost meanwhile, BEGIN again (`answer_again`): a lost key gets
    /// the response under a new token, so a retry replays it instead of
    /// running the handler again (boxed: a rare path, kept out of every
    /// request's state).
    pub async fn store<B>(&self, stored: &impl ResponseParts) -> Override<B> {
        match self
            .complete_answer(self.token, stored, Origin::Handler)
            .await
        {
            Err(err) if err.is_transient() => {
                tracing::warn!(key = self.key, error = %err, "COMPLETE failed: storing the response goes on in the background");
                self.store_in_background(stored.to_stored());
                self.not_stored()
            }
            result => self.settle(result, stored).await,
        }
    }

    /// The answer when the response could not be stored for now: with
    /// `replica_ack`, 503 (the client must not take it as durable; the key
    /// is kept, and a retry gets 409 or the replay once it is stored);
    /// without, the response itself.
    fn not_stored<B>(&self) -> Override<B> {
        let ack = self.config.replica_ack.filter(|_| self.answering);
        ack.map(|_| {
            self.observer.replica_ack_failed(AckFailure::NotStored);
            Problem::Unavailable.into_response()
        })
    }

    /// What a COMPLETE of the handler's response leaves the key with, in the
    /// request or after retrying in the background.
    async fn settle<B>(
        &self,
        result: Result<Stored, IdemError>,
        stored: &impl ResponseParts,
    ) -> Override<B> {
        match result {
            Ok(Stored::Durable) => None,
            Ok(Stored::Unacknowledged) => Some(Problem::Unavailable.into_response()),
            Err(IdemError::Stale(_)) => {
                tracing::warn!(
                    key = self.key,
                    "lease lost before COMPLETE (taken over): answering what the key holds now"
                );
                Box::pin(self.answer_again(stored)).await
            }
            Err(IdemError::NotFound(_)) => {
                tracing::warn!(
                    key = self.key,
                    "the key vanished from Redis before COMPLETE: storing the response under a new token"
                );
                Box::pin(self.answer_again(stored)).await
            }
            Err(err) if err.is_transient() => {
                if let Some(metrics) = self.observer.metrics() {
                    metrics.store_gave_up();
                }
                tracing::error!(key = self.key, error = %err, "gave up storing the response: a retry after the key's lease lapses runs the handler again");
                None
            }
            Err(err) => {
                tracing::error!(key = self.key, error = %err, "COMPLETE refused: the response is sent but not stored; key released");
                self.release().await;
                None
            }
        }
    }

    /// The fence committed `stored` to Postgres: put it into Redis without
    /// handing it to the writer. It is the key's authoritative answer, so the
    /// client gets it whatever Redis says; but with `replica_ack`, an answer
    /// Redis stored without enough replicas acknowledging it, or could not
    /// store for now, is a 503: the retry replays it from Redis where it
    /// survived, else the fence's claim finds it in Postgres.
    pub async fn store_committed<B>(&self, stored: &StoredResponse) -> Override<B> {
        match self
            .complete_answer(self.token, stored, Origin::Mirror)
            .await
        {
            Ok(Stored::Durable) => None,
            Ok(Stored::Unacknowledged) => Some(Problem::Unavailable.into_response()),
            Err(err @ (IdemError::Stale(_) | IdemError::NotFound(_))) => {
                tracing::warn!(
                    key = self.key,
                    error = %err,
                    "the fenced response is committed in Postgres; Redis lost or passed on the key"
                );
                None
            }
            Err(err) => {
                tracing::error!(
                    key = self.key,
                    error = %err,
                    "the fenced response is committed in Postgres but could not be put into Redis"
                );
                if err.is_transient() {
                    self.not_stored()
                } else {
                    None
                }
            }
        }
    }

    /// The fence replayed `stored` from Postgres: refill Redis with it, or
    /// release the key when that fails. The client gets the replay either
    /// way, so no replica acknowledgement is waited for.
    pub async fn refill(&self, stored: &StoredResponse) {
        if let Err(err) = self.complete(self.token, stored, Origin::Mirror).await {
            tracing::warn!(key = self.key, error = %err, "could not refill redis from the fence's row");
            self.release().await;
        }
    }

    /// ABORT; a failure leaves the key to lapse with its lease.
    pub async fn release(&self) {
        if let Err(err) = self.config.client.abort(self.key, self.token).await {
            self.observer.redis_error(RedisOp::Abort, &err);
            tracing::warn!(key = self.key, error = %err, "ABORT failed; the key frees itself when its lease lapses");
        }
    }

    /// Retries storing the handler's response while Redis is unreachable,
    /// for up to `store_retry`, in a task of its own: a key left in progress
    /// would be taken over by a retry once its lease lapses, and the handler
    /// would run again. Outside a runtime it cannot, and the key is left to
    /// lapse.
    fn store_in_background(&self, stored: StoredResponse) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let config = Arc::clone(self.config);
        let (key, token, fingerprint) = (self.key.to_owned(), self.token, *self.fingerprint);
        let observer = self.observer.clone();
        let pending = observer.metrics().map(|metrics| metrics.store_pending());
        drop(runtime.spawn(async move {
            let _pending = pending;
            let held = Held {
                config: &config,
                key: &key,
                token,
                fingerprint: &fingerprint,
                observer: &observer,
                answering: false,
            };
            // The last attempt in the request may have landed: its fate is
            // unknown. A `store_retry` too large for the clock is "for ever".
            let now = Instant::now();
            let give_up = now.checked_add(config.store_retry).unwrap_or(now + FOREVER);
            let result = held
                .complete_until(token, &stored, Origin::Handler, give_up, true)
                .await
                .map(|()| Stored::Durable);
            if result.is_ok() {
                tracing::info!(key, "the response is stored after Redis came back");
            }
            // Lost or taken over meanwhile, it is stored under a new token
            // when nobody holds the key; the client has its answer already.
            let _: Override<()> = held.settle(result, &stored).await;
        }));
    }

    /// COMPLETE of the request's answer: with `replica_ack`, pipelined with
    /// its `WAIT` (one attempt: a retried COMPLETE could not be waited
    /// for); without, `complete`.
    async fn complete_answer(
        &self,
        token: u64,
        stored: &impl ResponseParts,
        origin: Origin,
    ) -> Result<Stored, IdemError> {
        let Some(ack) = self.config.replica_ack.filter(|_| self.answering) else {
            return self
                .complete(token, stored, origin)
                .await
                .map(|()| Stored::Durable);
        };
        let started = Instant::now();
        let result = self.complete_acknowledged(token, stored, origin, ack).await;
        self.observer.complete(started.elapsed());
        result
    }

    /// COMPLETE and `WAIT` on a dedicated connection; whether enough
    /// replicas acknowledged is counted and logged here.
    async fn complete_acknowledged(
        &self,
        token: u64,
        stored: &impl ResponseParts,
        origin: Origin,
        ack: ReplicaAck,
    ) -> Result<Stored, IdemError> {
        let waited = self
            .config
            .client
            .complete_replicated_parts(self.key, token, stored, origin, ack.replicas, ack.timeout)
            .await
            .inspect_err(|err| self.observer.redis_error(RedisOp::Complete, err))?;
        let (reason, acked) = match waited {
            Ok(acked) if acked >= ack.replicas => return Ok(Stored::Durable),
            Ok(acked) => (AckFailure::Missed, acked),
            Err(err) => {
                self.observer.redis_error(RedisOp::Wait, &err);
                tracing::warn!(key = self.key, error = %err, "WAIT after COMPLETE failed");
                (AckFailure::WaitFailed, 0)
            }
        };
        self.observer.replica_ack_failed(reason);
        tracing::warn!(
            key = self.key,
            acked,
            wanted = ack.replicas,
            "the response is stored but too few replicas acknowledged it in time: answering 503, the key kept"
        );
        Ok(Stored::Unacknowledged)
    }

    /// COMPLETE, retried while Redis is unreachable for a moment.
    async fn complete(
        &self,
        token: u64,
        stored: &impl ResponseParts,
        origin: Origin,
    ) -> Result<(), IdemError> {
        let started = Instant::now();
        let give_up = started + STORE_AT_ONCE;
        let result = self
            .complete_until(token, stored, origin, give_up, false)
            .await;
        self.observer.complete(started.elapsed());
        result
    }

    /// COMPLETE, retried while Redis is unavailable until `give_up`. After
    /// an attempt whose fate is unknown (a timeout, a cut connection; also
    /// one made before, when `uncertain`), a `COMPLETED` is that attempt's
    /// own write: the module checks the token first, and only this holder
    /// has it.
    async fn complete_until(
        &self,
        token: u64,
        stored: &impl ResponseParts,
        origin: Origin,
        give_up: Instant,
        mut uncertain: bool,
    ) -> Result<(), IdemError> {
        let mut pause = PAUSE_FIRST;
        loop {
            match self
                .config
                .client
                .complete_parts(self.key, token, stored, origin)
                .await
                .inspect_err(|err| self.observer.redis_error(RedisOp::Complete, err))
            {
                Err(err) if err.is_transient() && Instant::now() < give_up => {
                    uncertain = true;
                    let left = give_up.saturating_duration_since(Instant::now());
                    tokio::time::sleep(pause.min(left)).await;
                    pause = (pause * 2).min(PAUSE_MAX);
                }
                Err(IdemError::Completed(_)) if uncertain => return Ok(()),
                result => return result,
            }
        }
    }

    /// BEGIN again after a `STALE` or `NOTFOUND` COMPLETE: the replay, 409
    /// while a newer holder runs, or, when nobody holds the key any more, the
    /// handler's own response stored under the new token.
    async fn answer_again<B>(&self, stored: &impl ResponseParts) -> Override<B> {
        match begin(self.config, self.key, self.fingerprint).await {
            Ok(Outcome::Replay(now)) => Some(replay_response(now)),
            Ok(Outcome::InFlight { retry_after }) => Some(
                Problem::InFlight {
                    retry_after: retry_after.min(self.config.max_retry_after),
                }
                .into_response(),
            ),
            Ok(Outcome::Mismatch) => Some(Problem::Mismatch.into_response()),
            Ok(Outcome::New { token }) => {
                let again = Held { token, ..*self };
                match again.complete_answer(token, stored, Origin::Handler).await {
                    Ok(Stored::Durable) => None,
                    Ok(Stored::Unacknowledged) => Some(Problem::Unavailable.into_response()),
                    Err(err) if err.is_transient() => {
                        tracing::warn!(key = self.key, error = %err, "could not store the response under a new token yet: retrying in the background");
                        again.store_in_background(stored.to_stored());
                        again.not_stored()
                    }
                    Err(err) => {
                        tracing::warn!(key = self.key, error = %err, "could not store the response under a new token");
                        again.release().await;
                        None
                    }
                }
            }
            Err(err) => {
                self.observer.redis_error(RedisOp::Begin, &err);
                tracing::warn!(key = self.key, error = %err, "BEGIN after a failed COMPLETE failed");
                self.not_stored()
            }
        }
    }
}

/// A handler's response as the key stores it: its status, its body and the
/// layer's `stored_headers`, read from the response where they are (only a
/// COMPLETE retried in the background takes a copy).
pub(crate) struct Handled<'a> {
    parts: &'a response::Parts,
    body: &'a Bytes,
    names: &'a [HeaderName],
}

impl ResponseParts for Handled<'_> {
    fn status(&self) -> u16 {
        self.parts.status.as_u16()
    }

    fn body(&self) -> &[u8] {
        self.body
    }

    fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> + Clone + Sync + '_ {
        StoredHeaders {
            map: &self.parts.headers,
            names: self.names.iter(),
            current: None,
        }
    }

    fn to_stored(&self) -> StoredResponse {
        let mut stored = StoredResponse::new(self.status(), self.body.clone());
        for (name, value) in self.headers() {
            let name = String::from_utf8_lossy(name).into_owned();
            stored = stored.with_header(name, Bytes::copy_from_slice(value));
        }
        stored
    }
}

/// Every value of each name, names in order, values in the map's order.
/// (`http`'s value iterator cannot be cloned; an encoder walks the headers
/// twice, to size the command and to write it.)
#[derive(Clone)]
struct StoredHeaders<'a> {
    map: &'a HeaderMap,
    names: std::slice::Iter<'a, HeaderName>,
    /// The name being read and how many of its values were given.
    current: Option<(&'a HeaderName, usize)>,
}

impl<'a> Iterator for StoredHeaders<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some((name, given)) = &mut self.current {
                if let Some(value) = self.map.get_all(&**name).iter().nth(*given) {
                    *given += 1;
                    return Some((name.as_str().as_bytes(), value.as_bytes()));
                }
            }
            self.current = Some((self.names.next()?, 0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_headers_are_every_value_of_each_name_in_order() {
        let response = Response::builder()
            .status(201)
            .header("x-b", "1")
            .header("content-type", "application/json")
            .header("x-b", "2")
            .header("x-other", "not stored")
            .body(())
            .unwrap();
        let (parts, ()) = response.into_parts();
        let names = [
            HeaderName::from_static("x-b"),
            HeaderName::from_static("location"),
            HeaderName::from_static("content-type"),
        ];
        let body = Bytes::from_static(b"{}");
        let handled = Handled {
            parts: &parts,
            body: &body,
            names: &names,
        };
        let expected = StoredResponse::new(201, "{}")
            .with_header("x-b", "1")
            .with_header("x-b", "2")
            .with_header("content-type", "application/json");
        assert_eq!(handled.to_stored(), expected);
        // Walked twice (sized, then written), it gives the same pairs.
        let pairs: Vec<_> = handled.headers().collect();
        assert_eq!(pairs, handled.headers().collect::<Vec<_>>());
        assert_eq!(pairs.len(), 3);
    }
}
