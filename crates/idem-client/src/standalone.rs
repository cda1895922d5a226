//! `StandaloneConnection`: what `IdemClient::standalone` talks to one Redis
//! node through. A [`Pipe`] where it can (TCP or a Unix socket, RESP2),
//! redis-rs' reconnecting `ConnectionManager` otherwise (TLS, RESP3), or
//! whichever [`Transport`] asks for.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::call::DEFAULT_CALL_TIMEOUT;
use crate::pipe::Pipe;

/// Which connection `IdemClient::standalone_with` makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// A [`Pipe`] when the address allows one, else a `ConnectionManager`.
    #[default]
    Auto,
    /// A [`Pipe`]; connecting fails for TLS or RESP3.
    Pipe,
    /// redis-rs' `ConnectionManager`.
    Manager,
}

/// A connection to one Redis node: a [`Pipe`] or redis-rs'
/// `ConnectionManager`. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub enum StandaloneConnection {
    /// idem's lean multiplexed connection.
    Pipe(Pipe),
    /// redis-rs' reconnecting multiplexed connection.
    Manager(ConnectionManager),
}

impl std::fmt::Debug for StandaloneConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StandaloneConnection::Pipe(pipe) => pipe.fmt(f),
            StandaloneConnection::Manager(_) => f.write_str("ConnectionManager"),
        }
    }
}

impl StandaloneConnection {
    /// Connects to the node `client` names the way `transport` says.
    pub async fn connect(
        client: &redis::Client,
        transport: Transport,
    ) -> redis::RedisResult<StandaloneConnection> {
        let pipe = match transport {
            Transport::Pipe => true,
            Transport::Manager => false,
            Transport::Auto => Pipe::supports(client.get_connection_info()).is_ok(),
        };
        if pipe {
            return Ok(StandaloneConnection::Pipe(Pipe::connect(client).await?));
        }
        // No response timeout of its own: every call is bounded by the
        // client's call timeout already.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1))
            .set_connection_timeout(Some(DEFAULT_CALL_TIMEOUT))
            .set_response_timeout(None);
        let manager = ConnectionManager::new_with_config(client.clone(), config).await?;
        Ok(StandaloneConnection::Manager(manager))
    }
}

impl StandaloneConnection {
    fn as_conn(&mut self) -> &mut dyn ConnectionLike {
        match self {
            StandaloneConnection::Pipe(pipe) => pipe,
            StandaloneConnection::Manager(manager) => manager,
        }
    }
}

impl ConnectionLike for StandaloneConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.as_conn().req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.as_conn().req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        match self {
            StandaloneConnection::Pipe(pipe) => pipe.get_db(),
            StandaloneConnection::Manager(manager) => manager.get_db(),
        }
    }
}
