//! `IdemClient`: the IDEM.* commands over any async redis-rs connection
//! (idem's `Pipe`, multiplexed, connection manager, cluster), each call
//! bounded by a timeout; and COMPLETE with a replica acknowledgement
//! (`WAIT`) on a dedicated connection. Each command goes to the module, or
//! to the Functions library's function of the same name where the module is
//! not loaded (`Backend`).

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::args::{self, Abort, BeginArgs, Call, CompleteArgs, Encode, KeyToken, Touch};
use idem_core::wire::ReplayLayout;
use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::Value;

use crate::backend::{self, library_missing, Backend, Resolved};
use crate::call::{bounded, DEFAULT_CALL_TIMEOUT};
use crate::outcome::ResponseParts;
use crate::pipe::Pipe;
use crate::reply::{parse_abort, parse_begin, parse_ok, parse_touch};
use crate::standalone::{StandaloneConnection, Transport};
use crate::wait_connections::{DedicatedConnections, WaitConnections};
use crate::{BeginOptions, IdemError, Origin, Outcome, StoredResponse};

/// Async client for the idem module. Cheap to clone; clones share the
/// connection.
///
/// ```
/// use std::time::Duration;
/// use idem_client::{BeginOptions, IdemClient, MemoryStore, Origin, Outcome, StoredResponse};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_client::IdemError> {
/// // `IdemClient::standalone(redis::Client::open(url)?)` for a real server.
/// let client = IdemClient::memory(MemoryStore::new());
/// let options = BeginOptions::new(Duration::from_secs(3600));
/// let Outcome::New { token } = client.begin("idem:{order-1}", b"request", options).await? else {
///     unreachable!("a fresh key is new");
/// };
/// let response = StoredResponse::new(201, "created");
/// client.complete("idem:{order-1}", token, &response, Origin::Handler).await?;
/// // The same request again gets the stored response.
/// let again = client.begin("idem:{order-1}", b"request", options).await?;
/// assert_eq!(again, Outcome::Replay(response));
/// // Another request under the same key is a mismatch.
/// let other = client.begin("idem:{order-1}", b"other", options).await?;
/// assert_eq!(other, Outcome::Mismatch);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct IdemClient<C> {
    conn: C,
    wait_connections: Option<Arc<dyn WaitConnections>>,
    call_timeout: Duration,
    /// Whether BEGIN asks for packed replays (`PACKED`): on until a module
    /// from before the option refuses it, then off for this client and its
    /// clones.
    packed: Arc<AtomicBool>,
    /// The module, or the library's functions or scripts.
    backend: Resolved,
}

/// On the library, a BEGIN with a wait is polled: again after the holder's
/// `retry_after`, at most this long at first, the pause doubling up to
/// `POLL_MAX`, until the wait runs out.
const POLL_FIRST: Duration = Duration::from_millis(2);
const POLL_MAX: Duration = Duration::from_millis(50);

impl<C> std::fmt::Debug for IdemClient<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemClient")
            .field("call_timeout", &self.call_timeout)
            .field("can_wait", &self.wait_connections.is_some())
            .field("packed", &self.packed.load(Ordering::Relaxed))
            .field("backend", &self.backend.backend())
            .finish_non_exhaustive()
    }
}

impl IdemClient<StandaloneConnection> {
    /// A client for one Redis server: a [`Pipe`](crate::Pipe) (or, for TLS
    /// and RESP3, redis-rs' `ConnectionManager`) for the ordinary calls and
    /// dedicated connections for `WAIT`; the backend found on the server
    /// (`Backend::Auto`).
    pub async fn standalone(client: redis::Client) -> Result<Self, IdemError> {
        IdemClient::standalone_with(client, Transport::Auto).await
    }

    /// `standalone` over the connection `transport` names.
    pub async fn standalone_with(
        client: redis::Client,
        transport: Transport,
    ) -> Result<Self, IdemError> {
        IdemClient::standalone_using(client, transport, Backend::Auto).await
    }

    /// `standalone_with`, calling `backend` (see [`Backend`]); fails with
    /// `NotInstalled` when the server has no way to run it.
    pub async fn standalone_using(
        client: redis::Client,
        transport: Transport,
        backend: Backend,
    ) -> Result<Self, IdemError> {
        let conn = StandaloneConnection::connect(&client, transport).await?;
        let wait = DedicatedConnections::standalone(client);
        IdemClient::new(conn)
            .with_wait_connections(Arc::new(wait))
            .resolve_backend(backend)
            .await
    }
}

impl IdemClient<ClusterConnection> {
    /// A client for a Redis Cluster: one cluster connection for the ordinary
    /// calls and dedicated cluster connections for `WAIT`.
    pub async fn cluster(client: redis::cluster::ClusterClient) -> Result<Self, IdemError> {
        IdemClient::cluster_using(client, Backend::Auto).await
    }

    /// `cluster`, calling `backend` (see [`Backend`]); the library is
    /// loaded on every primary.
    pub async fn cluster_using(
        client: redis::cluster::ClusterClient,
        backend: Backend,
    ) -> Result<Self, IdemError> {
        let conn = client.get_async_connection().await?;
        let wait = DedicatedConnections::cluster(client);
        IdemClient::new(conn)
            .with_wait_connections(Arc::new(wait))
            .resolve_backend(backend)
            .await
    }
}

impl<C> IdemClient<C> {
    /// Wraps an existing connection, calling the module's commands
    /// (`resolve_backend` to find or choose another backend). Without
    /// `with_wait_connections`, a `begin` with `wait` on the module fails
    /// with `NoWaitConnections`: a blocked command would stall every other
    /// command sharing this connection.
    pub fn new(conn: C) -> Self {
        IdemClient {
            conn,
            wait_connections: None,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            packed: Arc::new(AtomicBool::new(true)),
            backend: Resolved::Module,
        }
    }

    /// The backend this client calls (never `Auto`).
    pub fn backend(&self) -> Backend {
        self.backend.backend()
    }

    /// Connections used only for blocking calls: `IDEM.BEGIN ... WAIT` and
    /// `complete_replicated`.
    pub fn with_wait_connections(mut self, wait: Arc<dyn WaitConnections>) -> Self {
        self.wait_connections = Some(wait);
        self
    }

    /// Bound on each non-blocking call (default 2 s); past it the call fails
    /// with `IdemError::Unavailable`.
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Whether BEGIN asks for replays packed into one string (default on;
    /// they cost less to read). A module from before `PACKED` refuses the
    /// option; the client then retries the call without it and stops asking,
    /// so a rolling upgrade needs no setting. The setting is this client's
    /// and its later clones', not shared with clones made before.
    pub fn with_packed_replies(mut self, packed: bool) -> Self {
        self.packed = Arc::new(AtomicBool::new(packed));
        self
    }

    /// Whether `begin` may be given a `wait`: wait connections are set, or
    /// the backend is the library (whose wait is polled on the shared
    /// connection).
    pub fn can_wait(&self) -> bool {
        self.wait_connections.is_some() || !self.backend.blocks()
    }

    /// Whether `complete_replicated` can run: wait connections that keep a
    /// pipeline on one connection (`DedicatedConnections`; not
    /// `MemoryStore`'s).
    pub fn can_ack_replicas(&self) -> bool {
        self.wait_connections
            .as_ref()
            .is_some_and(|wait| wait.runs_pipelines())
    }
}

impl<C> IdemClient<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Settles which backend this client calls: `Auto` finds one (the
    /// module, else the library's functions, else its scripts), any other
    /// is checked; the library is loaded when it is missing or older. Fails
    /// with `NotInstalled` when nothing of idem can run on the server
    /// (the error says what to do), `Unavailable` when it did not answer.
    pub async fn resolve_backend(mut self, backend: Backend) -> Result<Self, IdemError> {
        self.backend = backend::resolve(&self.conn, backend, self.call_timeout).await?;
        tracing::debug!(backend = %self.backend(), "idem backend");
        Ok(self)
    }

    /// `IDEM.BEGIN`. With `options.wait`, a first non-blocking BEGIN runs on
    /// the shared connection; only when it answers `in_flight` does a second,
    /// blocking one run on a dedicated connection. On the library (which
    /// answers at once), the wait is a poll instead: BEGIN again after the
    /// holder's `retry_after`, at most a short pause that grows, until the
    /// wait runs out.
    pub async fn begin(
        &self,
        key: &str,
        fingerprint: &[u8],
        options: BeginOptions,
    ) -> Result<Outcome, IdemError> {
        let wait = options.wait.filter(|w| !w.is_zero());
        if !self.backend.blocks() {
            let first = self
                .query_begin(begin_args(key, fingerprint, options, None), None)
                .await?;
            return match wait {
                Some(wait) => Ok(self
                    .poll_begin(first, key, fingerprint, options, wait)
                    .await),
                None => Ok(first),
            };
        }
        let wait_connections = match wait {
            Some(_) => Some(
                self.wait_connections
                    .as_ref()
                    .ok_or(IdemError::NoWaitConnections)?,
            ),
            None => None,
        };
        let first = self
            .query_begin(begin_args(key, fingerprint, options, None), None)
            .await?;
        match (first, wait, wait_connections) {
            (first @ Outcome::InFlight { .. }, Some(wait), Some(connections)) => {
                let args = begin_args(key, fingerprint, options, Some(wait));
                let bound = wait + self.call_timeout;
                match self.query_begin(args, Some((&**connections, bound))).await {
                    // Waiting is an extra. When it fails in any way (the
                    // node unreachable, or `UNBLOCKED` by a demotion), the key
                    // is still known to be in flight, and that is the answer:
                    // never "unavailable", which a fail-open caller takes as
                    // leave to run what would be a certain duplicate.
                    Err(error) => {
                        tracing::warn!(%error, "waiting for the key's holder failed; answering in_flight");
                        Ok(first)
                    }
                    waited => waited,
                }
            }
            (outcome, _, _) => Ok(outcome),
        }
    }

    /// The library's wait: BEGIN again while the key is in flight, until
    /// `wait` runs out. A failed poll answers the last `in_flight`, as a
    /// failed blocking wait does.
    async fn poll_begin(
        &self,
        mut outcome: Outcome,
        key: &str,
        fingerprint: &[u8],
        options: BeginOptions,
        wait: Duration,
    ) -> Outcome {
        let deadline = tokio::time::Instant::now() + wait;
        let mut pause = POLL_FIRST;
        while let Outcome::InFlight { retry_after, .. } = outcome {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let sleep = retry_after
                .min(pause)
                .max(Duration::from_millis(1))
                .min(left);
            tokio::time::sleep(sleep).await;
            pause = (pause * 2).min(POLL_MAX);
            match self
                .query_begin(begin_args(key, fingerprint, options, None), None)
                .await
            {
                Ok(next) => outcome = next,
                Err(error) => {
                    tracing::warn!(%error, "polling for the key's holder failed; answering in_flight");
                    break;
                }
            }
        }
        outcome
    }

    /// Sends a BEGIN on the shared connection, or with `wait` on a wait
    /// connection for at most the bound given, packed unless turned off. A
    /// refusal of `PACKED` changed nothing on the server: the call is sent
    /// again without it, and the option is off from then on.
    async fn query_begin<'a>(
        &self,
        mut args: BeginArgs<'a>,
        wait: Option<(&dyn WaitConnections, Duration)>,
    ) -> Result<Outcome, IdemError> {
        if self.packed.load(Ordering::Relaxed) {
            args.replay = ReplayLayout::Packed;
        }
        let send = |args: BeginArgs<'a>| async move {
            match wait {
                None => self.call(&args).await,
                // Only the module blocks: its own command.
                Some((connections, bound)) => {
                    let cmd = args.via(self.backend.head()).to_cmd();
                    connections.query(cmd, bound).await
                }
            }
        };
        match send(args).await {
            Err(IdemError::BadArg(detail))
                if args.replay == ReplayLayout::Packed && args::refuses_packed(&detail) =>
            {
                self.packed.store(false, Ordering::Relaxed);
                args.replay = ReplayLayout::Fields;
                parse_begin(send(args).await?)
            }
            reply => parse_begin(reply?),
        }
    }

    /// `IDEM.COMPLETE`: stores the response for the holder of `token`.
    pub async fn complete(
        &self,
        key: &str,
        token: u64,
        response: &StoredResponse,
        origin: Origin,
    ) -> Result<(), IdemError> {
        self.complete_parts(key, token, response, origin).await
    }

    /// `complete` of any response's parts (the middleware's borrowed view).
    pub(crate) async fn complete_parts(
        &self,
        key: &str,
        token: u64,
        response: &impl ResponseParts,
        origin: Origin,
    ) -> Result<(), IdemError> {
        let command = CompleteArgs {
            key: key.as_bytes(),
            token,
            status: response.status(),
            body: response.body(),
            headers: response.headers(),
            mirrored: origin == Origin::Mirror,
        };
        parse_ok(&self.call(&command).await?)
    }

    /// `IDEM.COMPLETE`, then `WAIT replicas timeout` pipelined behind it on
    /// a dedicated connection (one round trip; a blocked `WAIT` would stall a
    /// shared connection, and it counts the writes of its own connection,
    /// so the COMPLETE goes first on the same one). Answers how many
    /// replicas acknowledged the stored response within `timeout`: fewer
    /// than `replicas` means a failover now may lose it (the record stays
    /// completed on this primary either way). A `WAIT` that fails after the
    /// COMPLETE is logged and answers 0. An error is the COMPLETE's, as
    /// from `complete`; when the round trip takes longer than `timeout`
    /// plus the call timeout, `Unavailable`: the COMPLETE's fate is unknown.
    ///
    /// Refused before anything is sent: `replicas` 0 or a zero `timeout`
    /// (`WAIT` with 0 blocks for ever) with `BadArg`, a client without wait
    /// connections with `NoWaitConnections`.
    pub async fn complete_replicated(
        &self,
        key: &str,
        token: u64,
        response: &StoredResponse,
        origin: Origin,
        replicas: u32,
        timeout: Duration,
    ) -> Result<u32, IdemError> {
        let acked = self
            .complete_replicated_parts(key, token, response, origin, replicas, timeout)
            .await?;
        Ok(acked.unwrap_or_else(|error| {
            tracing::warn!(key, %error, "WAIT after COMPLETE failed: no replica known to hold the response");
            0
        }))
    }

    /// `complete_replicated` of any response's parts: the COMPLETE's
    /// result, and inside it the `WAIT`'s (the replicas that acknowledged).
    pub(crate) async fn complete_replicated_parts(
        &self,
        key: &str,
        token: u64,
        response: &impl ResponseParts,
        origin: Origin,
        replicas: u32,
        timeout: Duration,
    ) -> Result<Result<u32, IdemError>, IdemError> {
        check_replica_ack(replicas, timeout).map_err(IdemError::BadArg)?;
        let connections = self
            .wait_connections
            .as_ref()
            .ok_or(IdemError::NoWaitConnections)?;
        let complete = CompleteArgs {
            key: key.as_bytes(),
            token,
            status: response.status(),
            body: response.body(),
            headers: response.headers(),
            mirrored: origin == Origin::Mirror,
        };
        let mut pipeline = redis::pipe();
        pipeline.add_command(complete.via(self.backend.head()).to_cmd());
        pipeline.cmd("WAIT").arg(replicas).arg(millis(timeout));
        let bound = timeout.saturating_add(self.call_timeout);
        let mut replies = connections.query_pipeline(pipeline.clone(), bound).await?;
        // The library gone from the node: nothing was stored, so load it
        // and send the pair once more.
        let missing = replies.first().is_some_and(|completed| {
            completed
                .clone()
                .extract_error()
                .is_err_and(|error| library_missing(&IdemError::from(error)))
        });
        if missing && !self.backend.blocks() {
            self.reload().await?;
            replies = connections.query_pipeline(pipeline, bound).await?;
        }
        let [completed, waited]: [Value; 2] =
            replies.try_into().map_err(|replies: Vec<Value>| {
                IdemError::UnexpectedReply(format!(
                    "{} replies to COMPLETE and WAIT",
                    replies.len()
                ))
            })?;
        let completed = completed
            .extract_error()
            .map_err(IdemError::from)
            .and_then(|value| parse_ok(&value));
        match completed {
            Ok(()) => {}
            // A client that sent the pipeline again (a cluster connection
            // retrying it after a reconnect or a redirect) finds its own
            // first COMPLETE: only this token's holder could have completed
            // it. Stored; what the WAIT counted then says nothing of it.
            Err(IdemError::Completed(detail)) => {
                return Ok(Err(IdemError::Completed(format!(
                    "{detail} (sent again: the acknowledgement is unknown)"
                ))));
            }
            Err(err) => return Err(err),
        }
        Ok(match waited.extract_error() {
            Ok(Value::Int(acked)) => Ok(u32::try_from(acked.max(0)).unwrap_or(u32::MAX)),
            Ok(other) => Err(IdemError::UnexpectedReply(format!(
                "WAIT answered {other:?}"
            ))),
            Err(err) => Err(IdemError::from(err)),
        })
    }

    /// `IDEM.ABORT`: releases the key. `false` when `token` no longer holds
    /// an in-progress record (taken over, completed or gone).
    pub async fn abort(&self, key: &str, token: u64) -> Result<bool, IdemError> {
        let command = Abort(KeyToken {
            key: key.as_bytes(),
            token,
        });
        parse_abort(&self.call(&command).await?)
    }

    /// `IDEM.TOUCH`: extends the holder's lease to now + `lease`; answers the
    /// remaining lease.
    pub async fn touch(
        &self,
        key: &str,
        token: u64,
        lease: Duration,
    ) -> Result<Duration, IdemError> {
        let command = Touch {
            key: key.as_bytes(),
            token,
            lease_ms: millis(lease),
        };
        parse_touch(&self.call(&command).await?)
    }

    /// One command on one record, to the backend: on the library, a reply
    /// saying it is missing on the node (`ERR Function not found`,
    /// `NOSCRIPT`) loads it and sends the command once more (the missing
    /// function ran nothing).
    async fn call(&self, command: &(impl Call + Sync)) -> Result<Value, IdemError> {
        let head = self.backend.head();
        match self.query(&command.via(head)).await {
            Err(error) if !self.backend.blocks() && library_missing(&error) => {
                self.reload().await?;
                self.query(&command.via(head)).await
            }
            reply => reply,
        }
    }

    /// Loads the library again on the shared connection (on a cluster, on
    /// every primary).
    async fn reload(&self) -> Result<(), IdemError> {
        backend::reload(&self.conn, &self.backend, self.call_timeout).await
    }

    /// One call on the shared connection, bounded by the call timeout; an
    /// error reply is an error. The command is sent at the first poll:
    /// through a [`Pipe`] written straight from its encoder, through any
    /// other connection as a redis-rs `Cmd`.
    async fn query(&self, command: &(impl Encode + Sync)) -> Result<Value, IdemError> {
        let value = match self.pipe() {
            Some(pipe) => bounded(self.call_timeout, pipe.call(command)).await?,
            None => {
                let (mut conn, cmd) = (self.conn.clone(), command.to_cmd());
                bounded(self.call_timeout, conn.req_packed_command(&cmd)).await?
            }
        };
        value.extract_error().map_err(IdemError::from)
    }

    /// The shared connection when it is a [`Pipe`] (resolved when the
    /// client's type is known: a type check the compiler folds away).
    fn pipe(&self) -> Option<&Pipe> {
        let conn: &dyn Any = &self.conn;
        match conn.downcast_ref::<StandaloneConnection>() {
            Some(StandaloneConnection::Pipe(pipe)) => Some(pipe),
            Some(StandaloneConnection::Manager(_)) => None,
            None => conn.downcast_ref::<Pipe>(),
        }
    }
}

/// BEGIN's arguments, with the default replay layout.
fn begin_args<'a>(
    key: &'a str,
    fingerprint: &'a [u8],
    options: BeginOptions,
    wait: Option<Duration>,
) -> BeginArgs<'a> {
    BeginArgs {
        key: key.as_bytes(),
        fingerprint,
        ttl_secs: args::ttl_secs(options.ttl),
        lease_ms: options.lease.map(millis),
        wait_ms: wait.map(millis),
        replay: ReplayLayout::Fields,
    }
}

/// Checks a replica acknowledgement's settings: at least one replica, and
/// a timeout (`WAIT` with 0 blocks for ever). The error says which and why.
pub(crate) fn check_replica_ack(replicas: u32, timeout: Duration) -> Result<(), String> {
    if replicas == 0 {
        return Err(
            "replica acknowledgement: replicas must be at least 1 (WAIT 0 waits for no replica)"
                .into(),
        );
    }
    if timeout.is_zero() {
        return Err(
            "replica acknowledgement: the timeout must be more than zero (WAIT with timeout 0 blocks for ever)"
                .into(),
        );
    }
    Ok(())
}

/// Whole milliseconds (rounded up), at least 1.
fn millis(d: Duration) -> u64 {
    args::duration_ms(d).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn begin_command_carries_lease_and_wait() {
        let opts = BeginOptions::new(Duration::from_secs(60)).lease(Duration::from_millis(250));
        let cmd = begin_args("k", b"fp", opts, Some(Duration::from_millis(40))).to_cmd();
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let expected: Vec<&[u8]> = vec![
            b"IDEM.BEGIN",
            b"k",
            b"fp",
            b"60",
            b"LEASE",
            b"250",
            b"WAIT",
            b"40",
        ];
        assert_eq!(args, expected);
    }
}
