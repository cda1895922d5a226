//! One Redis primary as the mirror sees it: a dedicated connection for the
//! blocking pull and the acknowledgements, reopened after any failure.

use std::time::Duration;

use idem_core::args::{duration_ms, Ack, Encode, KeyToken, Pull};
use idem_core::functions::{self as lib, outbox_key};
use idem_core::wire::ErrorCode;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, ErrorKind, RedisResult, ServerErrorKind, Value};

use crate::error::{Error, Result};
use crate::topology::target::Target;

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Slack on top of the pull's BLOCK before the reply counts as lost.
const RESPONSE_SLACK: Duration = Duration::from_secs(5);

pub struct RedisNode {
    client: Client,
    label: String,
    config: AsyncConnectionConfig,
    conn: Option<MultiplexedConnection>,
}

impl RedisNode {
    /// `block` is the longest BLOCK this connection will be asked to wait.
    pub fn open(target: &Target, block: Duration) -> Result<Self> {
        let client = Client::open(target.info.clone())
            .map_err(|e| Error::Config(format!("invalid Redis address {}: {e}", target.label)))?;
        let label = target.label.clone();
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(block + RESPONSE_SLACK));
        Ok(RedisNode {
            client,
            label,
            config,
            conn: None,
        })
    }

    /// `host:port/db` (no credentials), for logs and metric labels.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The connection, opened when there is none.
    async fn connection(&mut self) -> RedisResult<&mut MultiplexedConnection> {
        if self.conn.is_none() {
            let conn = self
                .client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await?;
            self.conn = Some(conn);
        }
        self.conn
            .as_mut()
            .ok_or_else(|| redis::RedisError::from((redis::ErrorKind::Io, "not connected")))
    }

    /// Connects when not connected.
    pub async fn connect(&mut self) -> RedisResult<()> {
        self.connection().await.map(|_| ())
    }

    /// After any error the connection is dropped, so the next call starts
    /// from a fresh one (a blocked or half-read connection is never reused).
    fn forget_on_error<T>(&mut self, result: &RedisResult<T>) {
        if result.is_err() {
            self.conn = None;
        }
    }

    /// `IDEM.MIRROR.PULL count CLAIM ms BLOCK ms`, the raw reply.
    pub async fn pull(
        &mut self,
        count: u32,
        claim: Duration,
        block: Duration,
    ) -> RedisResult<Value> {
        let cmd = Pull {
            count: count as usize,
            claim_ms: duration_ms(claim),
            block_ms: Some(duration_ms(block)),
        }
        .to_cmd();
        let result = match self.connection().await {
            Ok(conn) => cmd.query_async(conn).await,
            Err(e) => Err(e),
        };
        self.forget_on_error(&result);
        result
    }

    /// Pipelined `IDEM.MIRROR.ACK key token` for each pair. A key whose
    /// slot moved to another node (`MOVED`/`ASK`: a reshard took the record,
    /// pending, along) is skipped, and a node that became a replica
    /// (`READONLY`) ends the batch: either way the record is pending where it
    /// is now, and is pulled, upserted (a no-op) and acknowledged there. A
    /// key that refuses its ACK (see `refused`) is skipped too, so that one
    /// key cannot hold up the rest of the mirror.
    ///
    /// On a node running the Functions library (`functions`) each is
    /// `FCALL idem_mirror_ack 2 key outbox token`, answering alike.
    pub async fn ack(&mut self, acks: &[(&str, i64)], functions: bool) -> RedisResult<Acked> {
        if acks.is_empty() {
            return Ok(Acked::default());
        }
        let mut pipe = redis::pipe();
        for (key, token) in acks {
            pipe.add_command(ack_cmd(key, *token, functions));
        }
        let result: RedisResult<Vec<i64>> = match self.connection().await {
            Ok(conn) => pipe.query_async(conn).await,
            Err(e) => Err(e),
        };
        self.forget_on_error(&result);
        match result {
            Ok(replies) => Ok(Acked {
                superseded: replies.iter().filter(|r| **r != 1).count(),
                ..Acked::default()
            }),
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) => Ok(Acked {
                demoted: true,
                ..Acked::default()
            }),
            // The pipeline's first error hides the other replies: one by one.
            Err(e) if moved(&e) || refused(&e) => self.ack_each(acks, functions).await,
            Err(e) => Err(e),
        }
    }

    async fn ack_each(&mut self, acks: &[(&str, i64)], functions: bool) -> RedisResult<Acked> {
        let mut acked = Acked::default();
        for (key, token) in acks {
            let cmd = ack_cmd(key, *token, functions);
            let result: RedisResult<i64> = match self.connection().await {
                Ok(conn) => cmd.query_async(conn).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(1) => {}
                Ok(_) => acked.superseded += 1,
                Err(e) if moved(&e) => acked.moved += 1,
                Err(e) if refused(&e) => acked.refused.push(((*key).to_owned(), e.to_string())),
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) => {
                    acked.demoted = true;
                    return Ok(acked);
                }
                Err(e) => {
                    self.conn = None;
                    return Err(e);
                }
            }
        }
        Ok(acked)
    }

    /// One command on this connection (dropped after any error).
    pub async fn query_cmd(&mut self, cmd: &redis::Cmd) -> RedisResult<Value> {
        let result = match self.connection().await {
            Ok(conn) => cmd.query_async(conn).await,
            Err(e) => Err(e),
        };
        self.forget_on_error(&result);
        result
    }

    /// A pipeline on this connection, its replies (with `ignore_errors`,
    /// an error reply is a `Value::ServerError` among them); the connection
    /// is dropped after a failure of the pipeline as a whole.
    pub async fn query_pipe(&mut self, pipe: &redis::Pipeline) -> RedisResult<Vec<Value>> {
        let result = match self.connection().await {
            Ok(conn) => pipe.query_async(conn).await,
            Err(e) => Err(e),
        };
        self.forget_on_error(&result);
        result
    }

    /// `(idem_mirror_pending, idem_mirror_oldest_pending_ms)` from `INFO idem`
    /// (-1 for a field the node does not report).
    pub async fn mirror_info(&mut self) -> RedisResult<(i64, i64)> {
        let result: RedisResult<String> = match self.connection().await {
            Ok(conn) => redis::cmd("INFO").arg("idem").query_async(conn).await,
            Err(e) => Err(e),
        };
        self.forget_on_error(&result);
        let text = result?;
        let field = |name: &str| info_field(&text, name).unwrap_or(-1);
        Ok((
            field("idem_mirror_pending"),
            field("idem_mirror_oldest_pending_ms"),
        ))
    }
}

/// What became of a batch of acknowledgements.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Acked {
    /// Answered 0: the key expired or holds a newer token.
    pub superseded: usize,
    /// The key's slot is served by another node now.
    pub moved: usize,
    /// The node is a replica now; the rest of the batch was not sent.
    pub demoted: bool,
    /// Keys that refused their acknowledgement, with the error.
    pub refused: Vec<(String, String)>,
}

/// The key's slot is served by another node now.
fn moved(e: &redis::RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
    )
}

/// An error about one key, not the node: it holds something else now
/// (`WRONGTYPE`, `CORRUPT`), or the writer's ACL user may read it but not
/// write it (`NOPERM`). Retrying cannot help, so the key is skipped.
fn refused(e: &redis::RedisError) -> bool {
    matches!(
        e.code().and_then(|code| code.parse().ok()),
        Some(ErrorCode::WrongType | ErrorCode::Corrupt | ErrorCode::NoPerm)
    )
}

/// `FCALL idem_mirror_ack 2 key outbox token`.
pub(crate) fn library_ack_cmd(key: &str, token: i64) -> redis::Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(lib::MIRROR_ACK)
        .arg(2)
        .arg(key)
        .arg(outbox_key(key.as_bytes()))
        .arg(token);
    cmd
}

/// An integer field `name:value` of an INFO section.
fn info_field(text: &str, name: &str) -> Option<i64> {
    text.lines().find_map(|line| {
        let (field, value) = line.trim_end().split_once(':')?;
        (field == name).then(|| value.parse().ok()).flatten()
    })
}

/// `IDEM.MIRROR.ACK key token` (a negative token, which PULL never hands
/// out, is sent as 0 and refused by the module), or the library's
/// `idem_mirror_ack` when `functions`.
fn ack_cmd(key: &str, token: i64, functions: bool) -> redis::Cmd {
    if functions {
        return library_ack_cmd(key, token);
    }
    Ack(KeyToken {
        key: key.as_bytes(),
        token: u64::try_from(token).unwrap_or(0),
    })
    .to_cmd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_info_fields() {
        let text = "# idem\r\nidem_new:4\r\nidem_mirror_pending:12\r\nidem_mirror_oldest_pending_ms:340\r\n";
        assert_eq!(info_field(text, "idem_mirror_pending"), Some(12));
        assert_eq!(info_field(text, "idem_mirror_oldest_pending_ms"), Some(340));
        assert_eq!(info_field(text, "idem_mirror"), None);
    }
}
