//! The servers of a partition test, each in a host of a `netns::Net`:
//! `redis-server` with the module (a primary or a replica), Sentinels, and
//! a PostgreSQL standby streaming from a primary made by `Net::postgres`
//! (asynchronous or synchronous), promoted on demand. Every process is
//! killed and its directory removed on drop; the `Net`'s teardown kills
//! whatever is left in its namespaces.

use std::collections::HashMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{Host, Net};
use crate::postgres_server::{running_as_root, PgServer};
use crate::{module_path, scratch_dir, server_binary};

/// The port every Redis and Postgres of a partition test listens on: each
/// host is a namespace of its own, with its own ports.
pub const REDIS_PORT: u16 = 6400;
pub const SENTINEL_PORT: u16 = 26400;
pub const POSTGRES_PORT: u16 = 5440;

/// A `redis-server` with the module inside a host, on its address.
pub struct NsRedis {
    pub host: Host,
    pub dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl NsRedis {
    /// Starts a primary with `server_args` (`["--min-replicas-to-write",
    /// "1"]`) and returns once it answers.
    pub fn primary(host: &Host, server_args: &[&str]) -> NsRedis {
        let mut redis = NsRedis {
            host: host.clone(),
            dir: scratch_dir("nsredis"),
            args: server_args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        redis.spawn();
        redis
    }

    /// Starts a replica of `primary` and returns once it is in sync.
    pub fn replica(host: &Host, primary: &NsRedis, server_args: &[&str]) -> NsRedis {
        let mut args: Vec<&str> = server_args.to_vec();
        let (ip, port) = (primary.host.ip().to_string(), REDIS_PORT.to_string());
        args.extend(["--replicaof", &ip, &port]);
        let replica = NsRedis::primary(host, &args);
        let synced = crate::eventually(Duration::from_secs(20), || {
            replica.info("replication").get("master_link_status") == Some(&"up".to_string())
        });
        assert!(synced, "replica never synced:\n{}", replica.log());
        replica
    }

    fn spawn(&mut self) {
        let ip = self.host.ip().to_string();
        let mut cmd = self.host.command(server_binary());
        cmd.args(["--port", &REDIS_PORT.to_string(), "--bind", &ip])
            .args(["--protected-mode", "no", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args([
                "--repl-diskless-sync",
                "yes",
                "--repl-diskless-sync-delay",
                "0",
            ])
            .args(&self.args)
            .arg("--loadmodule")
            .arg(module_path())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("spawn redis-server in a namespace"));
        let up = crate::eventually(Duration::from_secs(20), || {
            self.query::<String>(&mut redis::cmd("PING")).is_ok()
        });
        assert!(
            up,
            "redis-server in {} not up:\n{}",
            self.host.name(),
            self.log()
        );
    }

    /// `redis://IP:PORT/`, reachable over the network.
    pub fn url(&self) -> String {
        format!("redis://{}:{REDIS_PORT}/", self.host.ip())
    }

    /// Runs `cmd` with a 2 s timeout (a partitioned server does not answer).
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> redis::RedisResult<T> {
        let timeout = Duration::from_secs(2);
        let client = redis::Client::open(self.url())?;
        let mut conn = client.get_connection_with_timeout(timeout)?;
        conn.set_read_timeout(Some(timeout))?;
        cmd.query(&mut conn)
    }

    /// `INFO section` as fields (empty when the server does not answer).
    pub fn info(&self, section: &str) -> HashMap<String, String> {
        let text: String = self
            .query(redis::cmd("INFO").arg(section))
            .unwrap_or_default();
        parse_info(&text)
    }

    /// `master` or `slave`, as `INFO replication` says.
    pub fn role(&self) -> Option<String> {
        self.info("replication").get("role").cloned()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NsRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn parse_info(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|line| line.trim().split_once(':'))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A `redis-server --sentinel` inside a host, monitoring a primary.
pub struct NsSentinel {
    pub host: Host,
    dir: PathBuf,
    child: Option<Child>,
}

impl NsSentinel {
    /// Monitors `primary` as service `name` with `quorum`; a primary silent
    /// for `down_after` is down.
    pub fn start(
        host: &Host,
        name: &str,
        primary: &NsRedis,
        quorum: usize,
        down_after: Duration,
    ) -> NsSentinel {
        let dir = scratch_dir("nssentinel");
        let config = dir.join("sentinel.conf");
        let (ip, primary_ip, ms) = (host.ip(), primary.host.ip(), down_after.as_millis());
        std::fs::File::create(&config)
            .and_then(|mut f| {
                write!(
                    f,
                    "port {SENTINEL_PORT}\nbind {ip}\nprotected-mode no\ndir {dir}\n\
                     logfile {dir}/sentinel.log\n\
                     sentinel monitor {name} {primary_ip} {REDIS_PORT} {quorum}\n\
                     sentinel down-after-milliseconds {name} {ms}\n\
                     sentinel failover-timeout {name} 4000\n\
                     sentinel parallel-syncs {name} 1\n",
                    dir = dir.display()
                )
            })
            .expect("write sentinel.conf");
        let child = host
            .command(server_binary())
            .arg(&config)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn a sentinel in a namespace");
        let sentinel = NsSentinel {
            host: host.clone(),
            dir,
            child: Some(child),
        };
        let up = crate::eventually(Duration::from_secs(20), || {
            sentinel.primary_addr(name).is_some()
        });
        assert!(up, "sentinel not up:\n{}", sentinel.log());
        sentinel
    }

    /// `redis://IP:PORT` of the sentinel.
    pub fn url(&self) -> String {
        format!("redis://{}:{SENTINEL_PORT}", self.host.ip())
    }

    /// The primary of `name` as this sentinel names it.
    pub fn primary_addr(&self, name: &str) -> Option<Ipv4Addr> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut conn = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let addr: Vec<String> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(name)
            .query(&mut conn)
            .ok()?;
        addr.first()?.parse().ok()
    }

    /// How many other sentinels it knows for `name`.
    pub fn others(&self, name: &str) -> usize {
        let Ok(client) = redis::Client::open(self.url()) else {
            return 0;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(2)) else {
            return 0;
        };
        let fields: redis::RedisResult<HashMap<String, String>> = redis::cmd("SENTINEL")
            .arg("master")
            .arg(name)
            .query(&mut conn);
        fields
            .ok()
            .and_then(|f| f.get("num-other-sentinels")?.parse().ok())
            .unwrap_or(0)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sentinel.log")).unwrap_or_default()
    }
}

impl Drop for NsSentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether a standby's commits wait for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names` empty: the primary acknowledges commits
    /// the standby may never get.
    Asynchronous,
    /// `synchronous_standby_names = '*'`, `synchronous_commit = on`: a
    /// commit is acknowledged once the standby has flushed it.
    Synchronous,
}

/// Lets `primary` (from `Net::postgres`) serve replication to the network
/// and makes its commits wait for a standby or not.
pub fn serve_replication(net: &Net, primary: &PgServer, mode: Replication) {
    let hba = primary.dir.join("data").join("pg_hba.conf");
    std::fs::OpenOptions::new()
        .append(true)
        .open(&hba)
        .and_then(|mut f| writeln!(f, "host replication all {} trust", net.subnet()))
        .unwrap_or_else(|e| panic!("append to {}: {e}", hba.display()));
    let names = match mode {
        Replication::Asynchronous => "",
        Replication::Synchronous => "*",
    };
    primary.psql(&format!(
        "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
    ));
    primary.psql("SELECT pg_reload_conf()");
}

/// A PostgreSQL standby inside a host: `pg_basebackup -R` from a primary,
/// then streaming; `promote` makes it a primary. Stopped (immediately) and
/// its directory removed on drop.
pub struct PgStandby {
    pub host: Host,
    pub port: u16,
    pub dir: PathBuf,
    running: bool,
}

impl PgStandby {
    /// A standby of `primary` (which `serve_replication` prepared), started
    /// in `host` on `primary`'s port; returns once it streams.
    pub fn start(host: &Host, primary_host: &Host, primary: &PgServer) -> PgStandby {
        let dir = scratch_dir("pgstandby");
        if running_as_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .expect("run chown");
            assert!(status.success(), "chown {}", dir.display());
        }
        let mut standby = PgStandby {
            host: host.clone(),
            port: primary.port,
            dir,
            running: false,
        };
        let data = standby.data_dir();
        let (primary_ip, port) = (primary_host.ip().to_string(), primary.port.to_string());
        standby.run_checked(
            "pg_basebackup",
            &[
                "-h",
                &primary_ip,
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                path_str(&data),
                "-R",
                "-X",
                "stream",
                "--checkpoint=fast",
                "--no-sync",
            ],
        );
        let log = standby.dir.join("postgres.log");
        let options = format!(
            "-p {} -k {} -c listen_addresses={} -c hot_standby=on",
            standby.port,
            path_str(&standby.dir),
            host.ip()
        );
        standby.run_checked(
            "pg_ctl",
            &[
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                path_str(&data),
                "-l",
                path_str(&log),
                "-o",
                &options,
            ],
        );
        standby.running = true;
        let streaming = crate::eventually(Duration::from_secs(30), || {
            primary
                .psql("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")
                .trim()
                == "1"
        });
        assert!(streaming, "the standby never streamed:\n{}", standby.log());
        standby
    }

    /// Runs SQL through `psql` over the network, in database `postgres`.
    pub fn psql(&self, sql: &str) -> String {
        self.psql_on("postgres", sql)
    }

    /// Runs SQL through `psql` over the network, in database `db`.
    pub fn psql_on(&self, db: &str, sql: &str) -> String {
        let out = self.run_checked(
            "psql",
            &[
                "-h",
                &self.host.ip().to_string(),
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
                "-v",
                "ON_ERROR_STOP=1",
                "-Atqc",
                sql,
            ],
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Whether it still replays (`pg_is_in_recovery()`).
    pub fn in_recovery(&self) -> bool {
        self.psql("SELECT pg_is_in_recovery()").trim() == "t"
    }

    /// `pg_ctl promote`, waiting until it accepts writes; then, as a
    /// cluster manager does for a primary left without standbys, clears the
    /// `synchronous_standby_names` its base backup copied from the old
    /// primary (else every synchronous commit on it waits forever).
    pub fn promote(&self) {
        let data = self.data_dir();
        self.run_checked(
            "pg_ctl",
            &["promote", "-w", "-t", "60", "-D", path_str(&data)],
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.in_recovery() {
            assert!(Instant::now() < deadline, "not promoted:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        self.psql("ALTER SYSTEM RESET synchronous_standby_names");
        self.psql("SELECT pg_reload_conf()");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn run_checked(&self, program: &str, args: &[&str]) -> Output {
        let out = self.run(program, args);
        assert!(
            out.status.success(),
            "{program} {args:?} failed ({}):\n{}{}\nlog:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        out
    }

    /// Runs a Postgres binary in the standby's host, as `postgres` when we
    /// are root.
    fn run(&self, program: &str, args: &[&str]) -> Output {
        let binary = bin_dir().join(program);
        let mut cmd = self.host.command(if running_as_root() {
            Path::new("runuser")
        } else {
            binary.as_path()
        });
        if running_as_root() {
            cmd.args(["-u", "postgres", "--"]).arg(&binary);
        }
        cmd.args(args)
            .current_dir(&self.dir)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", binary.display()))
    }
}

impl Drop for PgStandby {
    fn drop(&mut self) {
        if self.running {
            let data = self.data_dir();
            let _ = self.run(
                "pg_ctl",
                &["stop", "-w", "-m", "immediate", "-D", path_str(&data)],
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The PostgreSQL binaries: `$PG_BIN_DIR`, else `pg_config --bindir`.
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let out = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .expect("run pg_config (or set PG_BIN_DIR)");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("scratch paths are UTF-8")
}
