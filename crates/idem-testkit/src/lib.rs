//! Test harness shared by every crate's integration tests: a `redis-server`
//! with the idem module loaded on a free port (killed on drop), and throwaway
//! Postgres databases (dropped on drop), and Redis Cluster / Sentinel set-ups
//! (`cluster`). Never touches port 6379.

pub mod cluster;
pub mod history;
#[cfg(feature = "http")]
pub mod http;
pub mod info;
pub mod managed;
pub mod nemesis;
pub mod netns;
pub mod partition;
pub mod postgres_server;
pub mod tls;
pub mod wire;

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The built module: `$IDEM_MODULE`, else the newest of the workspace's
/// `target/{release,debug}/libidem.so`.
pub fn module_path() -> PathBuf {
    if let Ok(p) = std::env::var("IDEM_MODULE") {
        return PathBuf::from(p);
    }
    let root = workspace_root();
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    ["release", "debug"]
        .iter()
        .map(|p| target.join(p).join("libidem.so"))
        .filter(|p| p.exists())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .expect("libidem.so not built: run `cargo build --release` (or set IDEM_MODULE)")
}

/// The server binary: `$IDEM_REDIS_SERVER` (another Redis or Valkey build,
/// see scripts/compat.sh), else `redis-server` from the PATH.
pub fn server_binary() -> PathBuf {
    std::env::var_os("IDEM_REDIS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("redis-server"))
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("testkit sits two levels below the workspace root")
        .to_path_buf()
}

/// Ports the test kit never hands out: the machine's Redis and the main job's.
const RESERVED_PORTS: [u16; 2] = [6379, 6390];

/// A TCP port nobody listens on right now, never handed out twice by this
/// process, never one of `RESERVED_PORTS`.
///
/// It comes from outside the kernel's ephemeral range: a port found free by
/// binding port 0 lies inside it, and any client connecting anywhere on the
/// machine could take it as its own end before the server binds it.
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let Some(pool) = port_pool() else {
        return ephemeral_port(); // no room outside the range: the old way
    };
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = rand::random_range(pool.clone());
        if !RESERVED_PORTS.contains(&port)
            && !handed_out.contains(&port)
            && TcpListener::bind(("127.0.0.1", port)).is_ok()
        {
            handed_out.insert(port);
            return port;
        }
    }
}

/// Ports below the kernel's ephemeral range (10000 and up), else above it;
/// `None` when neither leaves 1000 ports.
fn port_pool() -> Option<RangeInclusive<u16>> {
    let (low, high) = ephemeral_range()?.into_inner();
    if low > 11_000 {
        Some(10_000..=low - 1)
    } else if high < 64_535 {
        Some(high + 1..=65_535)
    } else {
        None
    }
}

/// The kernel's ephemeral port range (`ip_local_port_range`).
fn ephemeral_range() -> Option<RangeInclusive<u16>> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut bounds = text.split_whitespace().map(|n| n.parse::<u16>().ok());
    Some(bounds.next()??..=bounds.next()??)
}

/// A port the kernel hands out for `127.0.0.1:0` (inside its ephemeral range).
fn ephemeral_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind an ephemeral port")
            .port();
        if !RESERVED_PORTS.contains(&port) {
            return port;
        }
    }
}

/// A fresh scratch directory under the system temp dir, removed by the owner.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idem-{tag}-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// Options for a `redis-server` with the module.
#[derive(Debug, Clone, Default)]
pub struct RedisConfig {
    /// Module load arguments, e.g. `["lease-ms", "5000"]`.
    pub module_args: Vec<String>,
    /// Extra server options, e.g. `["--appendonly", "yes"]`.
    pub server_args: Vec<String>,
}

impl RedisConfig {
    pub fn module_arg(mut self, name: &str, value: &str) -> Self {
        self.module_args
            .extend([name.to_string(), value.to_string()]);
        self
    }

    pub fn server_arg(mut self, name: &str, value: &str) -> Self {
        self.server_args
            .extend([format!("--{name}"), value.to_string()]);
        self
    }

    /// AOF on with `appendfsync always`.
    pub fn aof_always(self) -> Self {
        self.server_arg("appendonly", "yes")
            .server_arg("appendfsync", "always")
    }

    pub fn start(self) -> RedisServer {
        RedisServer::start_with(self)
    }
}

/// A running `redis-server --loadmodule libidem.so`; killed and its
/// directory removed on drop.
pub struct RedisServer {
    pub port: u16,
    pub dir: PathBuf,
    config: RedisConfig,
    child: Option<Child>,
}

impl RedisServer {
    /// Default configuration: no persistence.
    pub fn start() -> Self {
        RedisConfig::default().start()
    }

    pub fn start_with(config: RedisConfig) -> Self {
        Self::start_on(config, free_port())
    }

    /// Starts on `port`, or on a fresh one when another socket took `port`
    /// after it was found free: any ephemeral bind on the machine (a client
    /// connecting anywhere) can win that race.
    fn start_on(config: RedisConfig, port: u16) -> Self {
        const ATTEMPTS: usize = 5;
        let mut server = RedisServer {
            port,
            dir: scratch_dir("redis"),
            config,
            child: None,
        };
        for _ in 1..ATTEMPTS {
            match server.try_spawn() {
                Ok(()) => return server,
                Err(log) if lost_port(&log, server.port) => server.port = free_port(),
                Err(log) => panic!("redis-server exited; log:\n{log}"),
            }
        }
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        if let Err(log) = self.try_spawn() {
            panic!("redis-server exited; log:\n{log}");
        }
    }

    /// Starts the server and waits until it answers; `Err(log)` when it
    /// exited instead.
    fn try_spawn(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "server already running");
        let mut cmd = Command::new(server_binary());
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(["--enable-debug-command", "yes"])
            .args(["--repl-diskless-sync-delay", "0"])
            .args(&self.config.server_args)
            .arg("--loadmodule")
            .arg(module_path())
            .args(&self.config.module_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("spawn redis-server (is it installed?)"));
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!("({status})\n{}", self.log()));
            }
            if let Ok(mut c) = self.client().get_connection() {
                // Bounded: until the server listens, the port may be anyone's.
                let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
                let pong: redis::RedisResult<String> = redis::cmd("PING").query(&mut c);
                if pong.is_ok() {
                    return Ok(());
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server not ready:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("redis url")
    }

    pub fn conn(&self) -> redis::Connection {
        self.client()
            .get_connection()
            .expect("connect to redis-server")
    }

    /// A multiplexed connection without a response timeout (tests send
    /// blocking commands on it).
    pub async fn async_conn(&self) -> redis::aio::MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        self.client()
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .expect("connect to redis-server")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    /// SIGKILL: no shutdown save, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `SHUTDOWN` with the server's own persistence settings, then wait.
    pub fn shutdown(&mut self) {
        if let Ok(mut c) = self.client().get_connection() {
            let _: redis::RedisResult<()> = redis::cmd("SHUTDOWN").query(&mut c);
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// Start again on the same port and directory (persistence tests).
    pub fn restart(&mut self) {
        self.spawn();
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// A replica of `primary` (same module, default options), returned
    /// once its link to the primary is up, the primary counts it online,
    /// and it acknowledges writes (a `WAIT` answers at once from then on).
    pub fn start_replica_of(primary: &RedisServer) -> RedisServer {
        let mut config = RedisConfig::default();
        config.server_args.extend([
            "--replicaof".to_string(),
            "127.0.0.1".to_string(),
            primary.port.to_string(),
        ]);
        let replica = config.start();
        let mut conn = replica.conn();
        let synced = eventually(Duration::from_secs(20), || {
            cluster::info(&mut conn, "replication")
                .get("master_link_status")
                .map(String::as_str)
                == Some("up")
        });
        assert!(synced, "the replica did not sync:\n{}", replica.log());
        let mut on_primary = primary.conn();
        let online = eventually(Duration::from_secs(20), || {
            cluster::info(&mut on_primary, "replication")
                .get("slave0")
                .is_some_and(|line| line.contains("state=online"))
        });
        assert!(online, "the primary never counted its replica online");
        // Online, a diskless-synced replica gets the command stream only
        // from its first ACK (sent every second): the first write after the
        // sync waited up to 0.9 s for its WAIT. A PUBLISH (propagated, no
        // key) and a WAIT for it end that here.
        let _: i64 = redis::cmd("PUBLISH")
            .arg("idem-testkit-replica-probe")
            .arg("1")
            .query(&mut on_primary)
            .expect("PUBLISH on the primary");
        let acked: i64 = redis::cmd("WAIT")
            .arg(1)
            .arg(10_000)
            .query(&mut on_primary)
            .expect("WAIT on the primary");
        assert_eq!(acked, 1, "the replica never acknowledged a write");
        replica
    }

    /// SIGSTOP: the server freezes (a stalled VM, a link that drops
    /// everything): its clients and its primary hear nothing, and connected
    /// ones do not notice. `thaw` resumes it; drop kills it frozen or not.
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    /// SIGCONT after `freeze`.
    pub fn thaw(&self) {
        self.signal("CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("the server is running");
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} redis-server");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether a server's log says it could not listen on `port`, or on its
/// cluster bus port (`port` + 10000, cluster-enabled servers), because
/// another socket has it (the wording of Redis and Valkey alike).
fn lost_port(log: &str, port: u16) -> bool {
    let taken = |port: u32| format!("127.0.0.1:{port}: bind: Address already in use");
    let (listen, bus) = (taken(port.into()), taken(u32::from(port) + 10000));
    log.lines()
        .any(|line| line.contains(&listen) || line.contains(&bus))
}

/// The Postgres server tests use: `$DATABASE_URL`, else the local one.
pub fn postgres_base_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_string())
}

/// A database created for one test and dropped (with its connections) on drop.
pub struct PgDatabase {
    pub name: String,
    pub url: String,
    admin_url: String,
}

impl PgDatabase {
    pub fn create() -> Self {
        let admin_url = postgres_base_url();
        let name = format!("idem_test_{:016x}", rand::random::<u64>());
        let url = with_database(&admin_url, &name);
        admin_sql(&admin_url, &format!("CREATE DATABASE {name}"));
        PgDatabase {
            name,
            url,
            admin_url,
        }
    }

    /// Connects (for use inside a tokio runtime).
    pub async fn connect(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        admin_sql(
            &self.admin_url,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}

/// `url` with its database name replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((u, q)) => (u, format!("?{q}")),
        None => (url, String::new()),
    };
    let authority = url.find("://").map_or(0, |i| i + 3);
    let path = url[authority..]
        .find('/')
        .map_or(url.len(), |i| authority + i);
    format!("{}/{db}{query}", &url[..path])
}

pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    tokio::spawn(conn);
    client
}

/// Runs one statement on its own thread and runtime, so it works from sync
/// code, from `Drop`, and from inside an async test alike.
fn admin_sql(url: &str, sql: &str) {
    let (url, sql) = (url.to_string(), sql.to_string());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let client = connect(&url).await;
            client
                .batch_execute(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        })
    })
    .join()
    .expect("admin statement thread");
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

/// Polls `check` (async) every 20 ms until it holds or `timeout` passes.
pub async fn eventually_async<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs a test body `async fn name(layout: L)` once per layout of
/// `idempotency_keys`, as `name::unpartitioned` and `name::partitioned`.
/// `L` is the caller's layout enum (`idem_writer::Layout`,
/// `idem_client::TableLayout`): `both_layouts!(idem_writer::Layout, name)`.
#[macro_export]
macro_rules! both_layouts {
    ($($layout:ident)::+, $name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unpartitioned() {
                super::$name($($layout)::+::Unpartitioned).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn partitioned() {
                super::$name($($layout)::+::Partitioned).await
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_taken_after_it_was_found_free_moves_the_server() {
        // As in the race: a client's connection took the port as its own end.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let port = client.local_addr().unwrap().port();
        let server = RedisServer::start_on(RedisConfig::default(), port);
        assert_ne!(server.port, port);
        let pong: String = redis::cmd("PING").query(&mut server.conn()).unwrap();
        assert_eq!(pong, "PONG");
        assert!(lost_port(&server.log(), port), "{}", server.log());
    }

    #[test]
    fn free_ports_lie_outside_the_ephemeral_range_and_are_never_repeated() {
        let range = ephemeral_range().expect("ip_local_port_range");
        let ports: Vec<u16> = (0..500).map(|_| free_port()).collect();
        for &port in &ports {
            assert!(!range.contains(&port), "{port} is in {range:?}");
            assert!(![6379, 6390].contains(&port));
        }
        let distinct: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
    }

    #[test]
    fn only_the_servers_own_port_counts_as_lost() {
        let log = "# Could not create server TCP listening socket 127.0.0.1:4321: bind: Address already in use";
        assert!(lost_port(log, 4321));
        assert!(!lost_port(log, 432));
        assert!(!lost_port(log, 1234));
        // A cluster node also binds port + 10000 for its bus.
        let bus = "# Could not create server TCP listening socket 127.0.0.1:41252: bind: Address already in use";
        assert!(lost_port(bus, 31252));
        assert!(!lost_port(bus, 41252 - 1));
    }
}
