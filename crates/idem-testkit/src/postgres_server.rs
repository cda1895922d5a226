//! A private, throwaway PostgreSQL cluster (initdb into a scratch dir, own
//! port, trust auth) for tests that must stop, crash or restart Postgres,
//! or reach it over a network they can cut (`Listen`, `netns`).

use std::ffi::OsString;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::{free_port, scratch_dir};

/// Where Debian puts the PostgreSQL 15 server binaries; `$PG_BIN_DIR` overrides.
const DEFAULT_BIN_DIR: &str = "/usr/lib/postgresql/15/bin";

/// The OS user that owns the cluster when the tests run as root (Postgres
/// refuses to run as root).
const CLUSTER_OWNER: &str = "postgres";

/// Where a cluster runs and listens.
#[derive(Debug, Clone)]
pub struct Listen {
    /// The network namespace the server runs in (`ip netns exec`, see
    /// `netns::Net::postgres`); `None`: the test's own.
    pub netns: Option<String>,
    /// Its `listen_addresses`, and the host of its URLs.
    pub addr: IpAddr,
    /// A network (CIDR) whose clients get trust auth too; initdb's trust
    /// covers the loopback only.
    pub trusted: Option<String>,
}

impl Default for Listen {
    /// The loopback of the test's own namespace.
    fn default() -> Self {
        Listen {
            netns: None,
            addr: Ipv4Addr::LOCALHOST.into(),
            trusted: None,
        }
    }
}

/// A running private Postgres cluster; stopped (immediately) and its
/// directory removed on drop. The superuser is `postgres`, auth is trust.
pub struct PgServer {
    pub port: u16,
    pub dir: PathBuf,
    bin_dir: PathBuf,
    listen: Listen,
    running: bool,
}

impl PgServer {
    /// `initdb` into a fresh scratch directory and start on a free port.
    pub fn start() -> Self {
        Self::start_with(Listen::default())
    }

    /// `initdb` into a fresh scratch directory and start on a free port,
    /// where `listen` says.
    pub fn start_with(listen: Listen) -> Self {
        let dir = scratch_dir("pg");
        let bin_dir = std::env::var("PG_BIN_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from(DEFAULT_BIN_DIR));
        let mut server = PgServer {
            port: free_port(),
            dir,
            bin_dir,
            listen,
            running: false,
        };
        if running_as_root() {
            let status = Command::new("chown")
                .args(["-R", &format!("{CLUSTER_OWNER}:{CLUSTER_OWNER}")])
                .arg(&server.dir)
                .status()
                .expect("run chown");
            assert!(status.success(), "chown {}", server.dir.display());
        }
        let data = server.data_dir();
        server.run_checked(
            "initdb",
            &[
                "--auth=trust",
                "--username=postgres",
                "--encoding=UTF8",
                "--no-sync",
                "-D",
                path_str(&data),
            ],
        );
        if let Some(network) = &server.listen.trusted {
            server.trust(network);
        }
        server.restart();
        server
    }

    /// `postgres://postgres@ADDR:PORT/postgres` (ADDR is 127.0.0.1 unless
    /// `Listen` said otherwise).
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// The URL of database `db` on this cluster.
    pub fn url_for(&self, db: &str) -> String {
        let addr = SocketAddr::new(self.listen.addr, self.port);
        format!("postgres://postgres@{addr}/{db}")
    }

    /// Creates database `db` and returns its URL.
    pub fn create_database(&self, db: &str) -> String {
        self.psql(&format!("CREATE DATABASE {db}"));
        self.url_for(db)
    }

    /// Runs SQL through `psql` against the `postgres` database.
    pub fn psql(&self, sql: &str) -> String {
        let (host, port) = (self.listen.addr.to_string(), self.port.to_string());
        let out = self.run_checked(
            "psql",
            &[
                "-h",
                &host,
                "-p",
                &port,
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-v",
                "ON_ERROR_STOP=1",
                "-Atqc",
                sql,
            ],
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Stops the server cleanly (`pg_ctl stop -m fast`).
    pub fn shutdown(&mut self) {
        self.stop("fast");
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`): no
    /// checkpoint, crash recovery on the next start.
    pub fn kill(&mut self) {
        self.stop("immediate");
    }

    /// Starts the server again (same port and data); stops it first (fast)
    /// when it is running.
    pub fn restart(&mut self) {
        if self.running {
            self.shutdown();
        }
        let data = self.data_dir();
        let log = self.dir.join("postgres.log");
        let options = format!(
            "-p {} -k {} -c listen_addresses={}",
            self.port,
            path_str(&self.dir),
            self.listen.addr
        );
        self.run_checked(
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
        self.running = true;
    }

    pub fn is_running(&self) -> bool {
        self.running
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Trust auth for TCP clients from `network` (pg_hba.conf, read at start).
    fn trust(&self, network: &str) {
        let hba = self.data_dir().join("pg_hba.conf");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&hba)
            .and_then(|mut file| writeln!(file, "host all all {network} trust"))
            .unwrap_or_else(|e| panic!("append to {}: {e}", hba.display()));
    }

    fn stop(&mut self, mode: &str) {
        if !self.running {
            return;
        }
        let data = self.data_dir();
        // A signal to the postmaster's pid: sent from here, it also works
        // once the server's namespace is gone.
        let stop = ["stop", "-w", "-m", mode, "-D", path_str(&data)];
        let out = self.run_in(None, "pg_ctl", &stop);
        self.running = false;
        if !out.status.success() {
            eprintln!(
                "pg_ctl stop -m {mode} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
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

    /// Runs a Postgres binary in the server's namespace.
    fn run(&self, program: &str, args: &[&str]) -> Output {
        self.run_in(self.listen.netns.as_deref(), program, args)
    }

    /// Runs a Postgres binary in `netns` (`None`: ours), as the cluster
    /// owner when we are root.
    fn run_in(&self, netns: Option<&str>, program: &str, args: &[&str]) -> Output {
        let binary = self.bin_dir.join(program);
        let mut argv: Vec<OsString> = Vec::new();
        if let Some(netns) = netns {
            argv.extend(["ip", "netns", "exec", netns].map(OsString::from));
        }
        if running_as_root() {
            argv.extend(["runuser", "-u", CLUSTER_OWNER, "--"].map(OsString::from));
        }
        argv.push(binary.as_os_str().to_owned());
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .args(args)
            .current_dir(&self.dir)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", binary.display()))
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("scratch paths are UTF-8")
}
