//! `Pipe`: one multiplexed RESP2 connection to one Redis node, lean enough
//! that a round trip costs little more than its two system calls.
//!
//! Callers append their command to a shared buffer and wait for their reply;
//! a writer task writes everything queued in one call, after the runtime has
//! run every task that was ready (so one write carries the commands of all
//! requests of that moment), and a reader task answers callers in order.
//! redis-rs' multiplexed connection writes after each command's wake-up and
//! reads through a generic codec; the difference measured per round trip is
//! in docs/benchmarks/http.md ("Middleware CPU per request").
//!
//! A broken connection (or one with calls unanswered for `STALL`) fails
//! every call waiting on it (an I/O error, which the client treats as
//! "unavailable") and the next call reconnects; a connect that fails is not
//! tried again for a short, growing delay, during which calls fail at once.
//! Every connect ends with a PING, so a server refusing the connection
//! (max clients, protected mode) fails the connect instead of answering a
//! caller.

mod command;
mod resp;

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use idem_core::args::Encode;

use redis::aio::ConnectionLike;
use redis::io::tcp::{socket2, TcpSettings};
use redis::{Cmd, ConnectionAddr, Pipeline, ProtocolVersion, RedisFuture, RedisResult, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{oneshot, Notify};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::call::DEFAULT_CALL_TIMEOUT;

/// Calls, and bytes of commands not yet written, queued on one connection
/// at most; more fail at once (the node is not keeping up, or not answering
/// at all).
const MAX_QUEUED: usize = 1 << 16;
const MAX_QUEUED_BYTES: usize = 64 * 1024 * 1024;
/// First and longest wait before another connect after one failed.
const RETRY_FIRST: Duration = Duration::from_millis(10);
const RETRY_MAX: Duration = Duration::from_secs(1);
/// Read buffer: grown by this much when it runs low.
const READ_CHUNK: usize = 64 * 1024;
/// A write buffer larger than this is not kept for reuse.
const KEEP_BUFFER: usize = 1024 * 1024;
/// With calls written and unanswered, this long without a byte from the
/// server takes the connection down (a peer gone without a reset leaves a
/// socket that would wait for ever); no IDEM.* command runs for so long.
const STALL: Duration = Duration::from_secs(10);

type Reply = oneshot::Sender<RedisResult<Value>>;

/// A multiplexed connection to one Redis node over TCP or a Unix socket,
/// speaking RESP2. Cheap to clone; clones share the connection, which closes
/// when the last clone is dropped. Replies are matched to calls by order, so
/// every command must get exactly one reply: no `SUBSCRIBE`, `MONITOR` or
/// `CLIENT REPLY OFF|SKIP` (a `Cmd` marked `set_no_response` is refused).
#[derive(Clone)]
pub struct Pipe {
    shared: Arc<Shared>,
    _closer: Arc<Closer>,
}

impl std::fmt::Debug for Pipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipe")
            .field("addr", self.shared.info.addr())
            .finish_non_exhaustive()
    }
}

struct Shared {
    info: redis::ConnectionInfo,
    state: Mutex<State>,
}

struct State {
    /// Commands not yet handed to the writer, in the order of `waiting`.
    out: Vec<u8>,
    /// How many commands `out` holds.
    queued: usize,
    /// Commands handed to the writer and not answered yet: a reply beyond
    /// them is one nobody asked for.
    written: usize,
    /// When `written` last rose from zero: a stall is counted from then (or
    /// from the last byte read, whichever is later), not from an idle read.
    busy_since: Option<Instant>,
    /// One entry per command written or queued, oldest first: replies come
    /// back in this order.
    waiting: VecDeque<Reply>,
    link: Link,
    /// After a failed connect: no new attempt before this.
    retry_at: Option<Instant>,
    retry_delay: Duration,
    last_error: String,
    /// The last connect's failure was the server refusing this client's
    /// settings (credentials, database): calls fail as a configuration
    /// error, not as an outage.
    refused: bool,
    /// Numbers each connection, so a task of an old one changes nothing.
    generation: u64,
}

enum Link {
    Up(Session),
    Connecting,
    Down,
    Closed,
}

struct Session {
    generation: u64,
    wake_writer: Arc<Notify>,
    /// Set once spawned: `up` spawns outside the lock (see there).
    tasks: Option<[AbortHandle; 2]>,
}

impl Session {
    fn abort(&self) {
        self.tasks.iter().flatten().for_each(AbortHandle::abort);
    }
}

/// Stops the connection's tasks when the last `Pipe` clone goes.
struct Closer(Arc<Shared>);

impl Drop for Closer {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        if let Link::Up(session) = std::mem::replace(&mut state.link, Link::Closed) {
            session.abort();
        }
        fail_all(
            &mut state,
            io::ErrorKind::NotConnected,
            "the connection was closed",
        );
    }
}

impl Pipe {
    /// Connects to the node `client` names (TCP or Unix socket, RESP2; with
    /// its username, password and database). Fails when the first connect
    /// fails, or for TLS or RESP3, which this connection does not speak.
    pub async fn connect(client: &redis::Client) -> RedisResult<Pipe> {
        let info = client.get_connection_info().clone();
        Pipe::supports(&info).map_err(|reason| {
            redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "Pipe cannot connect",
                reason.to_string(),
            ))
        })?;
        let shared = Arc::new(Shared {
            info,
            state: Mutex::new(State {
                out: Vec::new(),
                queued: 0,
                written: 0,
                busy_since: None,
                waiting: VecDeque::new(),
                link: Link::Connecting,
                retry_at: None,
                retry_delay: RETRY_FIRST,
                last_error: String::new(),
                refused: false,
                generation: 0,
            }),
        });
        match establish(&shared.info).await {
            Ok(stream) => shared.up(stream),
            Err(err) => {
                shared.lock().link = Link::Down;
                return Err(if settings_refused(&err) {
                    connect_error(true, &err.to_string())
                } else {
                    err.into()
                });
            }
        }
        Ok(Pipe {
            _closer: Arc::new(Closer(shared.clone())),
            shared,
        })
    }

    /// Whether `info` is a connection `Pipe` can make; `Err` says why not.
    pub fn supports(info: &redis::ConnectionInfo) -> Result<(), &'static str> {
        if info.redis_settings().protocol() != ProtocolVersion::RESP2 {
            return Err("it speaks RESP2 only");
        }
        match info.addr() {
            ConnectionAddr::Tcp(..) | ConnectionAddr::Unix(_) => Ok(()),
            _ => Err("it connects over plain TCP or a Unix socket only"),
        }
    }

    /// Queues `count` replies' worth of commands (written by `write`) and
    /// hands `receive` where each reply will arrive, in order. A `write`
    /// that fails or panics leaves nothing queued: the bytes of half a
    /// command would pair every later reply with the wrong caller.
    fn send(
        &self,
        count: usize,
        write: impl FnOnce(&mut Vec<u8>) -> RedisResult<()>,
        mut receive: impl FnMut(oneshot::Receiver<RedisResult<Value>>),
    ) -> Result<(), redis::RedisError> {
        let mut reconnect = None;
        let sent = self.send_locked(count, write, &mut receive, &mut reconnect);
        // Spawned with no lock held: a runtime that is shutting down drops
        // the future at once, and its guard's drop takes the lock.
        if let Some((runtime, guard)) = reconnect {
            runtime.spawn(Shared::reconnect(guard));
        }
        sent
    }

    fn send_locked(
        &self,
        count: usize,
        write: impl FnOnce(&mut Vec<u8>) -> RedisResult<()>,
        receive: &mut impl FnMut(oneshot::Receiver<RedisResult<Value>>),
        reconnect: &mut Option<(tokio::runtime::Handle, ConnectGuard)>,
    ) -> Result<(), redis::RedisError> {
        let mut state = self.shared.lock();
        match &state.link {
            Link::Up(_) | Link::Connecting => {}
            Link::Closed => return Err(io_error(io::ErrorKind::NotConnected, "closed")),
            Link::Down => {
                if state.retry_at.is_some_and(|at| Instant::now() < at) {
                    let detail = format!("reconnecting after: {}", state.last_error);
                    return Err(connect_error(state.refused, &detail));
                }
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    let detail = "reconnecting needs a Tokio runtime";
                    return Err(io_error(io::ErrorKind::NotConnected, detail));
                };
                state.link = Link::Connecting;
                // Made before the spawn: a future dropped before its first
                // poll still leaves the link down, not connecting for ever.
                *reconnect = Some((runtime, ConnectGuard(Some(self.shared.clone()))));
            }
        }
        if state.waiting.len() + count > MAX_QUEUED || state.out.len() > MAX_QUEUED_BYTES {
            return Err(io_error(
                io::ErrorKind::WouldBlock,
                "too many calls queued on the connection",
            ));
        }
        let start = state.out.len();
        match std::panic::catch_unwind(AssertUnwindSafe(|| write(&mut state.out))) {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                state.out.truncate(start);
                return Err(err);
            }
            Err(panic) => {
                state.out.truncate(start);
                drop(state);
                std::panic::resume_unwind(panic);
            }
        }
        state.queued += count;
        for _ in 0..count {
            let (tx, rx) = oneshot::channel();
            state.waiting.push_back(tx);
            receive(rx);
        }
        // The writer is woken once per batch: a non-empty buffer has a
        // wake-up pending already.
        if start == 0 {
            if let Link::Up(session) = &state.link {
                session.wake_writer.notify_one();
            }
        }
        Ok(())
    }

    /// Queues `command`, written straight from its encoder, and answers
    /// its reply: what `IdemClient` sends through a `Pipe` (no `Cmd`, no
    /// boxed future).
    pub(crate) fn call(&self, command: &impl Encode) -> PipeReply {
        self.queue_one(|out| command::write(command, out))
    }

    /// Queues one command written by `write`; its reply.
    fn queue_one(&self, write: impl FnOnce(&mut Vec<u8>) -> RedisResult<()>) -> PipeReply {
        let mut receiver = None;
        let sent = self.send(1, write, |rx| receiver = Some(rx));
        PipeReply(match sent {
            Ok(()) => Ok(receiver.expect("one receiver per command")),
            Err(err) => Err(Some(err)),
        })
    }
}

/// The reply to one [`Pipe::call`]; a call that could not be queued fails
/// at its first poll.
pub(crate) struct PipeReply(
    Result<oneshot::Receiver<RedisResult<Value>>, Option<redis::RedisError>>,
);

impl Future for PipeReply {
    type Output = RedisResult<Value>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            Ok(receiver) => Pin::new(receiver)
                .poll(cx)
                .map(|reply| reply.unwrap_or_else(|_| Err(dropped()))),
            Err(err) => Poll::Ready(Err(err.take().expect("PipeReply polled after completion"))),
        }
    }
}

impl ConnectionLike for Pipe {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.queue_one(|out| {
            // Replies are paired with callers by order: a command the server
            // does not answer would hand every later reply to the wrong one.
            if cmd.is_no_response() {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "Pipe sends only commands that get a reply",
                )));
            }
            cmd.write_packed_command(out);
            Ok(())
        }))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let mut receivers = Vec::with_capacity(offset + count);
        let sent = self.send(
            offset + count,
            |out| {
                out.extend_from_slice(&pipeline.get_packed_pipeline());
                Ok(())
            },
            |rx| receivers.push(rx),
        );
        Box::pin(async move {
            sent?;
            let mut replies = Vec::with_capacity(count);
            for (i, receiver) in receivers.into_iter().enumerate() {
                let reply = receiver.await.unwrap_or_else(|_| Err(dropped()))?;
                if i >= offset {
                    replies.push(reply);
                }
            }
            Ok(replies)
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.info.redis_settings().db()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent at every unlock: a panic elsewhere
        // leaves nothing half-done.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A connect after the link went down, started by a call.
    /// Dropped before it finished (its runtime shut down), it leaves the
    /// link down (`guard`), not connecting for ever.
    async fn reconnect(mut guard: ConnectGuard) {
        let Some(shared) = guard.0.clone() else {
            return;
        };
        let result = establish(&shared.info).await;
        guard.0 = None;
        match result {
            Ok(stream) => shared.up(stream),
            Err(err) => shared.connect_failed(settings_refused(&err), &err.to_string()),
        }
    }

    /// A connect failed: the calls queued for it fail, and none is tried
    /// again before a delay that doubles with each failure.
    /// `refused`: the server refused the connection's settings.
    fn connect_failed(&self, refused: bool, detail: &str) {
        let mut state = self.lock();
        if !matches!(state.link, Link::Connecting) {
            return;
        }
        state.link = Link::Down;
        state.retry_at = Some(Instant::now() + state.retry_delay);
        state.retry_delay = (state.retry_delay * 2).min(RETRY_MAX);
        state.last_error = detail.to_owned();
        state.refused = refused;
        fail_all_with(&mut state, || connect_error(refused, detail));
    }

    /// A fresh connection goes live: its writer and reader start, and what
    /// was queued meanwhile is written.
    fn up(self: &Arc<Self>, stream: Stream) {
        let (generation, wake_writer) = {
            let mut state = self.lock();
            if !matches!(state.link, Link::Connecting) {
                return; // closed meanwhile: the stream is dropped
            }
            state.generation += 1;
            state.refused = false;
            let generation = state.generation;
            let wake_writer = Arc::new(Notify::new());
            if !state.out.is_empty() {
                wake_writer.notify_one();
            }
            state.retry_at = None;
            state.retry_delay = RETRY_FIRST;
            state.link = Link::Up(Session {
                generation,
                wake_writer: wake_writer.clone(),
                tasks: None,
            });
            (generation, wake_writer)
        };
        // Spawned with no lock held: on a runtime that is shutting down
        // tokio drops a task's future inside `spawn`, and its guard takes
        // the connection down, which locks.
        let tasks = match stream {
            Stream::Tcp(stream) => {
                let (rd, wr) = stream.into_split();
                self.spawn_tasks(generation, &wake_writer, rd, wr)
            }
            Stream::Unix(stream) => {
                let (rd, wr) = stream.into_split();
                self.spawn_tasks(generation, &wake_writer, rd, wr)
            }
        };
        let mut state = self.lock();
        match &mut state.link {
            Link::Up(session) if session.generation == generation => session.tasks = Some(tasks),
            // Down or closed meanwhile (one of the tasks may have done it).
            _ => tasks.iter().for_each(AbortHandle::abort),
        }
    }

    fn spawn_tasks<R, W>(
        self: &Arc<Self>,
        generation: u64,
        wake_writer: &Arc<Notify>,
        rd: R,
        wr: W,
    ) -> [AbortHandle; 2]
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        // The guards go in as arguments: a task dropped before its first
        // poll drops them too.
        let guard = || TaskGuard(self.clone(), generation);
        let writer = self.clone().write(guard(), wake_writer.clone(), wr);
        let reader = self.clone().read(guard(), rd);
        let (writer, reader) = (tokio::spawn(writer), tokio::spawn(reader));
        [writer.abort_handle(), reader.abort_handle()]
    }

    async fn write<W: AsyncWrite + Unpin>(
        self: Arc<Self>,
        guard: TaskGuard,
        wake: Arc<Notify>,
        mut wr: W,
    ) {
        let generation = guard.1;
        let mut batch = Vec::new();
        loop {
            wake.notified().await;
            // Let every task that is ready queue its command first.
            tokio::task::yield_now().await;
            {
                let mut state = self.lock();
                if !state.is_current(generation) {
                    return;
                }
                std::mem::swap(&mut state.out, &mut batch);
                if state.written == 0 && state.queued > 0 {
                    state.busy_since = Some(Instant::now());
                }
                state.written += std::mem::take(&mut state.queued);
            }
            if batch.is_empty() {
                continue;
            }
            if let Err(err) = wr.write_all(&batch).await {
                self.down(generation, err.kind(), &format!("write failed: {err}"));
                return;
            }
            batch.clear();
            if batch.capacity() > KEEP_BUFFER {
                batch = Vec::new();
            }
        }
    }

    async fn read<R: AsyncRead + Unpin>(self: Arc<Self>, guard: TaskGuard, mut rd: R) {
        let generation = guard.1;
        let mut parser = resp::Parser::default();
        let mut buf = bytes::BytesMut::with_capacity(READ_CHUNK);
        let mut replies = Vec::new();
        let mut answered = Vec::new();
        let mut last_byte = Instant::now();
        let mut wait = STALL;
        loop {
            if buf.capacity() - buf.len() < READ_CHUNK / 4 {
                buf.reserve(READ_CHUNK);
            }
            let read = match tokio::time::timeout(wait, rd.read_buf(&mut buf)).await {
                Ok(read) => read,
                Err(_) => {
                    // Stalled only when calls waited STALL since they were
                    // written (or since the last byte, if later).
                    let busy_since = self.lock().busy_since;
                    let Some(since) = busy_since.map(|at| at.max(last_byte)) else {
                        wait = STALL; // idle
                        continue;
                    };
                    let stalled = since.elapsed();
                    if stalled < STALL {
                        wait = STALL - stalled;
                        continue;
                    }
                    let detail = format!("no reply for {STALL:?} to calls written");
                    return self.down(generation, io::ErrorKind::TimedOut, &detail);
                }
            };
            last_byte = Instant::now();
            wait = STALL;
            match read {
                Ok(0) => {
                    let detail = "the server closed the connection";
                    return self.down(generation, io::ErrorKind::UnexpectedEof, detail);
                }
                Ok(_) => {}
                Err(err) => {
                    return self.down(generation, err.kind(), &format!("read failed: {err}"));
                }
            }
            let mut used = 0;
            loop {
                match parser.next(&buf, &mut used) {
                    Ok(Some(value)) => replies.push(value),
                    Ok(None) => break,
                    Err(err) => {
                        let detail = err.to_string();
                        return self.down(generation, io::ErrorKind::InvalidData, &detail);
                    }
                }
            }
            let _ = buf.split_to(used);
            if replies.is_empty() {
                continue;
            }
            {
                let mut state = self.lock();
                if !state.is_current(generation) {
                    return;
                }
                if state.written < replies.len() {
                    drop(state);
                    let detail = "a reply nobody asked for";
                    return self.down(generation, io::ErrorKind::InvalidData, detail);
                }
                state.written -= replies.len();
                if state.written == 0 {
                    state.busy_since = None;
                }
                answered.extend(state.waiting.drain(..replies.len()));
            }
            // Answered outside the lock: each send wakes a caller.
            for (reply, value) in answered.drain(..).zip(replies.drain(..)) {
                let _ = reply.send(Ok(value));
            }
        }
    }

    /// Connection `generation` failed: every call on it fails, and the next
    /// call reconnects.
    fn down(&self, generation: u64, kind: io::ErrorKind, detail: &str) {
        let mut state = self.lock();
        if !state.is_current(generation) {
            return;
        }
        if let Link::Up(session) = std::mem::replace(&mut state.link, Link::Down) {
            session.abort();
        }
        tracing::warn!(addr = %self.info.addr(), error = detail, "redis connection lost");
        state.last_error = detail.to_owned();
        fail_all(&mut state, kind, detail);
    }
}

impl State {
    fn is_current(&self, generation: u64) -> bool {
        matches!(&self.link, Link::Up(session) if session.generation == generation)
    }
}

/// Fails every queued and unanswered call.
fn fail_all(state: &mut State, kind: io::ErrorKind, detail: &str) {
    fail_all_with(state, || io_error(kind, detail));
}

fn fail_all_with(state: &mut State, error: impl Fn() -> redis::RedisError) {
    state.out.clear();
    state.queued = 0;
    state.written = 0;
    state.busy_since = None;
    for reply in state.waiting.drain(..) {
        let _ = reply.send(Err(error()));
    }
}

fn io_error(kind: io::ErrorKind, detail: &str) -> redis::RedisError {
    io::Error::new(kind, detail.to_owned()).into()
}

/// What a connect whose settings the server refused fails with
/// (`handshake`), inside an `io::Error`: a type of its own, so no error of
/// the system (EACCES on a socket, say) is taken for it.
#[derive(Debug)]
struct SettingsRefused(String);

impl std::fmt::Display for SettingsRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SettingsRefused {}

/// Whether a failed connect is the server refusing the connection's
/// settings; any other failed connect is an outage.
fn settings_refused(err: &io::Error) -> bool {
    err.get_ref()
        .is_some_and(|inner| inner.is::<SettingsRefused>())
}

/// What a call gets while the link is down after a failed connect: the
/// server refusing the connection's settings is redis-rs'
/// `InvalidClientConfig` (a configuration error, `IdemError::Redis`),
/// anything else a refused connection (an outage, `IdemError::Unavailable`).
fn connect_error(refused: bool, detail: &str) -> redis::RedisError {
    if refused {
        let what = "the server refused the connection's settings";
        (
            redis::ErrorKind::InvalidClientConfig,
            what,
            detail.to_owned(),
        )
            .into()
    } else {
        io_error(io::ErrorKind::ConnectionRefused, detail)
    }
}

fn dropped() -> redis::RedisError {
    io_error(io::ErrorKind::BrokenPipe, "the connection dropped the call")
}

/// Takes connection `generation` down when its task ends for any reason
/// (its runtime shut down, too): its calls fail instead of waiting for ever.
struct TaskGuard(Arc<Shared>, u64);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.down(
            self.1,
            io::ErrorKind::BrokenPipe,
            "the connection's task stopped",
        );
    }
}

/// Fails a connect whose task was dropped before it finished (`None` once
/// it did).
struct ConnectGuard(Option<Arc<Shared>>);

impl Drop for ConnectGuard {
    fn drop(&mut self) {
        if let Some(shared) = &self.0 {
            shared.connect_failed(false, "the connect's task stopped");
        }
    }
}

enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

/// Connects and authenticates (AUTH, SELECT), within the default call timeout.
async fn establish(info: &redis::ConnectionInfo) -> io::Result<Stream> {
    match tokio::time::timeout(DEFAULT_CALL_TIMEOUT, open(info)).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("connect to {} timed out", info.addr()),
        )),
    }
}

async fn open(info: &redis::ConnectionInfo) -> io::Result<Stream> {
    let mut stream = match info.addr() {
        ConnectionAddr::Tcp(host, port) => {
            let stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
            apply_tcp_settings(&stream, info.tcp_settings())?;
            Stream::Tcp(stream)
        }
        ConnectionAddr::Unix(path) => Stream::Unix(tokio::net::UnixStream::connect(path).await?),
        other => {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("Pipe does not connect to {other}"),
            ))
        }
    };
    let settings = info.redis_settings();
    let mut setup = Vec::new();
    let mut replies = 0;
    if let Some(password) = settings.password() {
        let mut auth = redis::cmd("AUTH");
        if let Some(username) = settings.username() {
            auth.arg(username);
        }
        auth.arg(password).write_packed_command(&mut setup);
        replies += 1;
    }
    if settings.db() != 0 {
        redis::cmd("SELECT")
            .arg(settings.db())
            .write_packed_command(&mut setup);
        replies += 1;
    }
    // Always one round trip: a server that refuses the connection (max
    // clients, protected mode) says so before the connection counts as up.
    redis::cmd("PING").write_packed_command(&mut setup);
    replies += 1;
    match &mut stream {
        Stream::Tcp(s) => handshake(s, &setup, replies).await?,
        Stream::Unix(s) => handshake(s, &setup, replies).await?,
    }
    Ok(stream)
}

/// The connection info's TCP settings (keepalive; user timeout on Linux),
/// as redis-rs applies them; `TCP_NODELAY` is always on, since the writer batches itself.
fn apply_tcp_settings(stream: &tokio::net::TcpStream, settings: &TcpSettings) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let socket = socket2::SockRef::from(stream);
    if let Some(keepalive) = settings.keepalive() {
        socket.set_tcp_keepalive(keepalive)?;
    }
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    if let Some(timeout) = settings.user_timeout() {
        socket.set_tcp_user_timeout(Some(timeout))?;
    }
    Ok(())
}

/// Whether a setup reply refuses the connection's settings (credentials,
/// database): `WRONGPASS`, `NOAUTH`, `NOPERM`, or any `ERR` (a password the
/// server has none for, a database out of range) except the max-clients
/// refusal, which Redis sends on accepting, as it sends `DENIED` in
/// protected mode: those two are the server not taking a connection now.
fn refuses_settings(err: &redis::ServerError) -> bool {
    match err.code() {
        "WRONGPASS" | "NOAUTH" | "NOPERM" => true,
        "ERR" => !err
            .details()
            .is_some_and(|d| d.starts_with("max number of clients")),
        _ => false,
    }
}

/// Writes the setup commands and checks that each answered OK (PONG).
async fn handshake<S>(stream: &mut S, setup: &[u8], mut replies: usize) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(setup).await?;
    let mut buf = bytes::BytesMut::with_capacity(512);
    while replies > 0 {
        if stream.read_buf(&mut buf).await? == 0 {
            let detail = "the server closed the connection during setup";
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, detail));
        }
        while replies > 0 {
            let parsed = resp::parse(&buf)
                .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err.to_string()))?;
            let Some((value, used)) = parsed else { break };
            let _ = buf.split_to(used);
            replies -= 1;
            match value {
                Value::Okay => {}
                Value::SimpleString(pong) if pong == "PONG" && replies == 0 => {}
                Value::ServerError(err) if refuses_settings(&err) => {
                    let detail = format!("connection setup refused: {err}");
                    let refused = SettingsRefused(detail);
                    return Err(io::Error::new(io::ErrorKind::PermissionDenied, refused));
                }
                // Max clients or protected mode: an outage.
                Value::ServerError(err) => {
                    let detail = format!("connection setup refused: {err}");
                    return Err(io::Error::new(io::ErrorKind::ConnectionRefused, detail));
                }
                other => {
                    let detail = format!("connection setup answered {other:?}");
                    return Err(io::Error::new(io::ErrorKind::InvalidData, detail));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use idem_core::args::{ArgSink, Encode};
    use idem_testkit::RedisServer;
    use redis::Value;

    use super::Pipe;

    /// `ECHO word`, until the call that writes it (the second `encode`, after
    /// `size`) goes wrong: one argument fewer than measured, or a panic
    /// after the first argument.
    struct Faulty {
        fault: Fault,
        encodes: Cell<u32>,
    }

    #[derive(Clone, Copy)]
    enum Fault {
        Miscount,
        Panic,
    }

    impl Encode for Faulty {
        fn encode(&self, out: &mut impl ArgSink) {
            let writing = self.encodes.replace(self.encodes.get() + 1) > 0;
            out.arg(b"ECHO");
            match self.fault {
                Fault::Miscount if writing => {}
                Fault::Panic if writing => panic!("encoder failed"),
                _ => out.arg(b"word"),
            }
        }
    }

    struct Echo(&'static [u8]);

    impl Encode for Echo {
        fn encode(&self, out: &mut impl ArgSink) {
            out.arg(b"ECHO");
            out.arg(self.0);
        }
    }

    /// A command whose encoder fails or panics is queued not at all: the
    /// calls after it on the same connection get their own replies (before,
    /// its half-written bytes broke the stream for every later caller).
    #[tokio::test]
    async fn a_failing_encoder_leaves_nothing_queued() {
        let server = RedisServer::start();
        let pipe = Pipe::connect(&server.client()).await.unwrap();
        for fault in [Fault::Miscount, Fault::Panic] {
            let faulty = Faulty {
                fault,
                encodes: Cell::new(0),
            };
            match fault {
                Fault::Miscount => {
                    let err = pipe.call(&faulty).await.unwrap_err();
                    assert!(err.to_string().contains("miscounted"), "{err}");
                }
                Fault::Panic => {
                    let panicked = catch_unwind(AssertUnwindSafe(|| drop(pipe.call(&faulty))));
                    assert!(panicked.is_err(), "the encoder's panic reaches its caller");
                }
            }
            let (a, b) = (pipe.call(&Echo(b"a")), pipe.call(&Echo(b"b")));
            assert_eq!(a.await.unwrap(), Value::BulkString(b"a".to_vec()));
            assert_eq!(b.await.unwrap(), Value::BulkString(b"b".to_vec()));
        }
    }
}
