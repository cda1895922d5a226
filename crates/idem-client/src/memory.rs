//! `MemoryStore`: the `IDEM.*` commands run in-process on idem-core, the
//! module's own argument parser, decision table, token clock and reply
//! writer, behind redis-rs' `aio::ConnectionLike`. `IdemClient` and the
//! middleware run on it unchanged, so handlers are unit-tested with the layer
//! and no Redis. Replies go through redis-rs' own RESP parser, so a reply
//! (or an error such as `STALE`) reaches the client as a server's would.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use idem_core::args::{self, name};
use idem_core::engine::{self, Begin as Decision};
use idem_core::token::TokenClock;
use idem_core::wire::{self, ReplySink};
use idem_core::{Error, Record};
use redis::aio::ConnectionLike;
use redis::{Arg, Cmd, Pipeline, RedisFuture, RedisResult, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::call::bounded;
use crate::wait_connections::WaitConnections;
use crate::{IdemClient, IdemError};

pub use idem_core::args::Limits;

/// The commands a `MemoryStore` runs; any other is refused with `ERR`.
const COMMANDS: &str = "IDEM.BEGIN, IDEM.COMPLETE, IDEM.ABORT, IDEM.TOUCH and IDEM.GET";

/// An in-memory idem store: one keyspace of records, as one Redis database
/// with the module loaded. Clones share it.
///
/// - Time is tokio's clock (Unix time at creation plus tokio time since), so
///   `tokio::time::pause` and `advance` drive leases, lease takeovers and
///   key expiry in tests. A key is gone once its TTL has passed.
/// - `IDEM.BEGIN ... WAIT` waits as the module does: it answers when the
///   holder completes (replay) or aborts or its lease lapses (a takeover:
///   `new`), or `in_flight` when the wait runs out. Waiters are not served
///   oldest first, and waiting needs no dedicated connection.
/// - The mirror does not exist: `MIRRORED` is accepted and changes nothing
///   visible; `IDEM.MIRROR.*` and `IDEM._PUT`, like every other command and
///   pipelines, are refused with an `ERR` reply (`IdemError::Redis`).
///
/// ```
/// use std::time::Duration;
/// use idem_client::{BeginOptions, IdemClient, IdemError, MemoryStore, Outcome};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), IdemError> {
/// let client = IdemClient::memory(MemoryStore::new());
/// let options = BeginOptions::new(Duration::from_secs(60)).lease(Duration::from_secs(5));
/// let Outcome::New { token: first } = client.begin("k", b"fp", options).await? else {
///     unreachable!()
/// };
/// // The holder crashes; once its lease lapses the next attempt takes over.
/// tokio::time::advance(Duration::from_secs(6)).await;
/// let Outcome::New { token: second } = client.begin("k", b"fp", options).await? else {
///     unreachable!()
/// };
/// assert!(second > first);
/// // The first holder is fenced off.
/// assert!(matches!(client.abort("k", first).await, Ok(false)));
/// assert!(matches!(client.touch("k", first, Duration::from_secs(1)).await, Err(IdemError::Stale(_))));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    keyspace: Mutex<Keyspace>,
    /// Woken whenever a record is completed or deleted (waiters look again).
    settled: Notify,
    limits: Limits,
    /// Unix ms at creation, and tokio's clock then.
    origin: (u64, Instant),
}

#[derive(Default)]
struct Keyspace {
    records: HashMap<Vec<u8>, Record>,
    tokens: TokenClock,
}

/// The record under `key`, unless its TTL has passed (then it is dropped,
/// as Redis expires the key).
fn live<'r>(
    records: &'r mut HashMap<Vec<u8>, Record>,
    key: &[u8],
    now: u64,
) -> Option<&'r mut Record> {
    if records.get(key).is_some_and(|r| r.expires_at <= now) {
        records.remove(key);
    }
    records.get_mut(key)
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("limits", &self.shared.limits)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// An empty store with the module's default configs.
    pub fn new() -> Self {
        MemoryStore::with_limits(Limits::DEFAULT)
    }

    /// An empty store with these configs (`max-ttl`, `max-body-bytes`,
    /// `lease-ms`).
    pub fn with_limits(limits: Limits) -> Self {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        MemoryStore {
            shared: Arc::new(Shared {
                keyspace: Mutex::default(),
                settled: Notify::new(),
                limits,
                origin: (unix_ms, Instant::now()),
            }),
        }
    }

    /// Unix ms on tokio's clock.
    fn now_ms(&self) -> u64 {
        let (unix_ms, at) = self.shared.origin;
        let since = Instant::now().saturating_duration_since(at).as_millis();
        unix_ms.saturating_add(u64::try_from(since).unwrap_or(u64::MAX))
    }

    fn keyspace(&self) -> std::sync::MutexGuard<'_, Keyspace> {
        self.shared
            .keyspace
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs one command: its reply, or the error reply a server would send.
    async fn run(&self, cmd: &Cmd) -> Result<Resp, Reply> {
        let argv: Vec<&[u8]> = cmd
            .args_iter()
            .map(|arg| match arg {
                Arg::Simple(bytes) => bytes,
                // A SCAN cursor: no command the store runs takes one.
                _ => b"0",
            })
            .collect();
        let Some((command, args)) = argv.split_first() else {
            return Err(Reply::Refused("empty command".into()));
        };
        let command = String::from_utf8_lossy(command).to_ascii_uppercase();
        let limits = &self.shared.limits;
        match command.as_str() {
            name::BEGIN => self.begin(args::begin(args, limits)?).await,
            name::COMPLETE => {
                let req = args::complete(args, limits)?;
                let now = self.now_ms();
                engine::complete(live(&mut self.keyspace().records, req.key, now), req, now)?;
                self.shared.settled.notify_waiters();
                Ok(Resp::write(|sink| sink.simple(c"OK")))
            }
            name::ABORT => {
                let req = args::key_token(args, "IDEM.ABORT key token")?;
                let now = self.now_ms();
                let mut keyspace = self.keyspace();
                let released = engine::may_abort(
                    live(&mut keyspace.records, req.key, now).as_deref(),
                    req.token,
                );
                if released {
                    keyspace.records.remove(req.key);
                    self.shared.settled.notify_waiters();
                }
                Ok(Resp::write(|sink| sink.int(i64::from(released))))
            }
            name::TOUCH => {
                let req = args::touch(args)?;
                let now = self.now_ms();
                let mut keyspace = self.keyspace();
                let rec = live(&mut keyspace.records, req.key, now);
                let remaining = engine::touch(rec, req.token, req.lease_ms, now)?;
                Ok(Resp::write(|sink| {
                    sink.int(i64::try_from(remaining).unwrap_or(i64::MAX))
                }))
            }
            name::GET => {
                let [key] = args else {
                    return Err(
                        Error::bad_arg("wrong number of arguments, usage: IDEM.GET key").into(),
                    );
                };
                let now = self.now_ms();
                let mut keyspace = self.keyspace();
                let rec = live(&mut keyspace.records, key, now);
                Ok(Resp::write(|sink| wire::write_record(sink, rec.as_deref())))
            }
            _ => Err(Reply::Refused(format!(
                "unknown command '{command}': the in-memory store runs {COMMANDS}"
            ))),
        }
    }

    /// `IDEM.BEGIN`; with `WAIT`, decides again whenever a record settles or
    /// the holder's lease lapses, until the wait runs out.
    async fn begin(&self, req: args::Begin<'_>) -> Result<Resp, Reply> {
        let deadline = req
            .wait_ms
            .filter(|&ms| ms > 0)
            .map(|ms| Instant::now() + Duration::from_millis(ms));
        loop {
            let settled = self.shared.settled.notified();
            tokio::pin!(settled);
            // Registered before deciding, so a settle in between is not missed.
            settled.as_mut().enable();
            let retry_after_ms = 'decide: {
                let now = self.now_ms();
                let mut keyspace = self.keyspace();
                let Keyspace { records, tokens } = &mut *keyspace;
                let record = live(records, req.key, now);
                let reply = match engine::begin(record, &req, || now, || tokens) {
                    Decision::Created(record) => {
                        let token = record.token;
                        records.insert(req.key.to_vec(), record);
                        wire::Begin::New { token }
                    }
                    Decision::TakenOver { token } => wire::Begin::New { token },
                    Decision::Replay(completed) => wire::Begin::Replay(completed),
                    Decision::Mismatch => wire::Begin::Mismatch,
                    Decision::InFlight { retry_after_ms } => {
                        if deadline.is_some_and(|d| Instant::now() < d) {
                            break 'decide retry_after_ms;
                        }
                        wire::Begin::InFlight { retry_after_ms }
                    }
                };
                return Ok(Resp::write(|sink| reply.write(sink, req.replay)));
            };
            let deadline = deadline.expect("only a waiting BEGIN gets here");
            let lapse = Instant::now() + Duration::from_millis(retry_after_ms);
            tokio::select! {
                () = settled => {}
                () = tokio::time::sleep_until(lapse.min(deadline)) => {}
            }
        }
    }
}

impl IdemClient<MemoryStore> {
    /// A client on `store`, waits included (they need no connection of
    /// their own here).
    pub fn memory(store: MemoryStore) -> Self {
        IdemClient::new(store.clone()).with_wait_connections(Arc::new(store))
    }
}

/// A reply as RESP2 bytes, written by idem-core's reply writers.
#[derive(Default)]
struct Resp(Vec<u8>);

impl Resp {
    fn write(f: impl FnOnce(&mut Resp)) -> Resp {
        let mut resp = Resp::default();
        f(&mut resp);
        resp
    }

    fn line(&mut self, kind: u8, text: &[u8]) {
        self.0.push(kind);
        self.0.extend_from_slice(text);
        self.0.extend_from_slice(b"\r\n");
    }
}

impl ReplySink for Resp {
    fn array(&mut self, len: usize) {
        self.line(b'*', len.to_string().as_bytes());
    }
    fn int(&mut self, v: i64) {
        self.line(b':', v.to_string().as_bytes());
    }
    fn bulk(&mut self, b: &[u8]) {
        self.line(b'$', b.len().to_string().as_bytes());
        self.0.extend_from_slice(b);
        self.0.extend_from_slice(b"\r\n");
    }
    fn simple(&mut self, s: &'static std::ffi::CStr) {
        self.line(b'+', s.to_bytes());
    }
    fn null(&mut self) {
        self.line(b'$', b"-1");
    }
}

/// An error reply: one of the module's, or `ERR` for what the store refuses.
enum Reply {
    Module(Error),
    Refused(String),
}

impl From<Error> for Reply {
    fn from(err: Error) -> Self {
        Reply::Module(err)
    }
}

impl Reply {
    fn into_resp(self) -> Resp {
        let text = match self {
            Reply::Module(err) => err.to_string(),
            Reply::Refused(msg) => format!("ERR {msg}"),
        };
        // An error reply is one line, as Redis sends it.
        let text = text.replace(['\r', '\n'], " ");
        Resp::write(|resp| resp.line(b'-', text.as_bytes()))
    }
}

/// The value (or error) redis-rs makes of the reply's bytes.
fn parse(resp: Resp) -> RedisResult<Value> {
    redis::parse_redis_value(&resp.0)?.extract_error()
}

impl ConnectionLike for MemoryStore {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let resp = self.run(cmd).await.unwrap_or_else(Reply::into_resp);
            parse(resp)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        _pipeline: &'a Pipeline,
        _offset: usize,
        _count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let refused = Reply::Refused("the in-memory store does not run pipelines".into());
            parse(refused.into_resp()).map(|value| vec![value])
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

impl WaitConnections for MemoryStore {
    fn query(&self, cmd: Cmd, timeout: Duration) -> BoxFuture<'_, Result<Value, IdemError>> {
        let mut store = self.clone();
        Box::pin(async move { bounded(timeout, store.req_packed_command(&cmd)).await })
    }
}
