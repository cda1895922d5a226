//! Connections reserved for blocking calls: `IDEM.BEGIN ... WAIT`, and
//! `IDEM.COMPLETE` pipelined with a replica `WAIT`. Redis stops reading a
//! blocked client's socket, so a blocking call on a shared (multiplexed)
//! connection would stall every other request behind it: each caller
//! borrows a connection of its own from this small pool.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisResult, Value};

use crate::call::{bounded, DEFAULT_CALL_TIMEOUT};
use crate::IdemError;

/// Runs one blocking command on a connection nobody else uses meanwhile.
pub trait WaitConnections: Send + Sync + 'static {
    /// Runs `cmd` for at most `timeout` (past it: `IdemError::Unavailable`).
    fn query(&self, cmd: Cmd, timeout: Duration) -> BoxFuture<'_, Result<Value, IdemError>>;

    /// Runs `pipeline`'s commands on one such connection, in one write, for
    /// at most `timeout`: their replies in order, a command's error reply
    /// as a `Value::ServerError` in its place. The replica acknowledgement
    /// needs it (`WAIT` counts its own connection's writes, so the COMPLETE
    /// it waits for goes first on the same connection). By default refused:
    /// an implementation that cannot keep the commands on one connection
    /// must not pretend to (and answers false to `runs_pipelines`).
    fn query_pipeline(
        &self,
        pipeline: Pipeline,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Vec<Value>, IdemError>> {
        let _ = (pipeline, timeout);
        Box::pin(async {
            Err(IdemError::Redis(redis::RedisError::from((
                redis::ErrorKind::Client,
                "these wait connections do not run pipelines (the replica acknowledgement needs DedicatedConnections)",
            ))))
        })
    }

    /// Whether `query_pipeline` runs pipelines (false by default, as it
    /// refuses them): the layer's `replica_ack` needs it.
    fn runs_pipelines(&self) -> bool {
        false
    }
}

type Opener<C> = Arc<dyn Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync>;

/// Opens connections on demand and keeps up to `max_idle` of them for reuse.
pub struct DedicatedConnections<C> {
    open: Opener<C>,
    idle: Mutex<Vec<C>>,
    max_idle: usize,
}

/// Idle connections kept by default.
pub const DEFAULT_MAX_IDLE: usize = 16;

impl DedicatedConnections<MultiplexedConnection> {
    /// Fresh multiplexed connections to one server (no response timeout of
    /// their own: each call is bounded by the wait plus the call timeout).
    pub fn standalone(client: redis::Client) -> Self {
        DedicatedConnections::new(move || {
            let client = client.clone();
            Box::pin(async move {
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(DEFAULT_CALL_TIMEOUT))
                    .set_response_timeout(None);
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
            })
        })
    }
}

impl DedicatedConnections<ClusterConnection> {
    /// Fresh cluster connections (each holds one socket per node it talks to).
    pub fn cluster(client: redis::cluster::ClusterClient) -> Self {
        DedicatedConnections::new(move || {
            let client = client.clone();
            Box::pin(async move { client.get_async_connection().await })
        })
    }
}

impl<C> DedicatedConnections<C>
where
    C: ConnectionLike + Send + 'static,
{
    /// A pool that opens connections with `open`.
    pub fn new(
        open: impl Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync + 'static,
    ) -> Self {
        DedicatedConnections {
            open: Arc::new(open),
            idle: Mutex::new(Vec::new()),
            max_idle: DEFAULT_MAX_IDLE,
        }
    }

    /// How many idle connections are kept [`DEFAULT_MAX_IDLE`].
    pub fn max_idle(mut self, max_idle: usize) -> Self {
        self.max_idle = max_idle;
        self
    }

    /// Connections currently idle in the pool.
    pub fn idle_count(&self) -> usize {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// An idle connection, or a new one opened within `timeout`.
    async fn checkout(&self, timeout: Duration) -> Result<C, IdemError> {
        match self.take_idle() {
            Some(conn) => Ok(conn),
            None => bounded(timeout, (self.open)()).await,
        }
    }

    fn take_idle(&self) -> Option<C> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    fn give_back(&self, conn: C) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < self.max_idle {
            idle.push(conn);
        }
    }
}

impl<C> WaitConnections for DedicatedConnections<C>
where
    C: ConnectionLike + Send + 'static,
{
    fn query(&self, cmd: Cmd, timeout: Duration) -> BoxFuture<'_, Result<Value, IdemError>> {
        Box::pin(async move {
            let mut conn = self.checkout(timeout).await?;
            let result = bounded(timeout, cmd.query_async::<Value>(&mut conn)).await;
            // Only a connection that answered goes back: one that timed out
            // may still deliver the late answer, one that failed on I/O is
            // broken, and a server error (`UNBLOCKED` by a demotion) may
            // come with the server closing it.
            if result.is_ok() {
                self.give_back(conn);
            }
            result
        })
    }

    fn runs_pipelines(&self) -> bool {
        true
    }

    fn query_pipeline(
        &self,
        pipeline: Pipeline,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Vec<Value>, IdemError>> {
        Box::pin(async move {
            let mut conn = self.checkout(timeout).await?;
            let count = pipeline.len();
            let result = bounded(timeout, conn.req_packed_commands(&pipeline, 0, count)).await;
            // As in `query`; a reply holding an error goes back neither.
            let answered = result.as_ref().is_ok_and(|values| {
                values.len() == count && !values.iter().any(|v| matches!(v, Value::ServerError(_)))
            });
            if answered {
                self.give_back(conn);
            }
            result
        })
    }
}
