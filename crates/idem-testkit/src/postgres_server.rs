//! A private, throwaway PostgreSQL cluster (initdb into a scratch dir, own
//! port, trust auth) for tests that must stop, crash or restart Postgres.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::{free_port, scratch_dir};

/// Where Debian puts the PostgreSQL 15 server binaries; `$PG_BIN_DIR` overrides.
const DEFAULT_BIN_DIR: &str = "/usr/lib/postgresql/15/bin";

/// The OS user that owns the cluster when the tests run as root (Postgres
/// refuses to run as root).
const CLUSTER_OWNER: &str = "postgres";

/// A running private Postgres cluster; stopped (immediately) and its
/// directory removed on drop. The superuser is `postgres`, auth is trust.
pub struct PgServer {
    pub port: u16,
    pub dir: PathBuf,
    bin_dir: PathBuf,
    running: bool,
}

impl PgServer {
    /// `initdb` into a fresh scratch directory and start on a free port.
    pub fn start() -> Self {
        let dir = scratch_dir("pg");
        let bin_dir = std::env::var("PG_BIN_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from(DEFAULT_BIN_DIR));
        let mut server = PgServer {
            port: free_port(),
            dir,
            bin_dir,
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
        server.restart();
        server
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// The URL of database `db` on this cluster.
    pub fn url_for(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Creates database `db` and returns its URL.
    pub fn create_database(&self, db: &str) -> String {
        self.psql(&format!("CREATE DATABASE {db}"));
        self.url_for(db)
    }

    /// Runs SQL through `psql` against the `postgres` database.
    pub fn psql(&self, sql: &str) -> String {
        let port = self.port.to_string();
        let out = self.run_checked(
            "psql",
            &[
                "-h",
                "127.0.0.1",
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
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            self.port,
            path_str(&self.dir)
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

    fn stop(&mut self, mode: &str) {
        if !self.running {
            return;
        }
        let data = self.data_dir();
        let out = self.run("pg_ctl", &["stop", "-w", "-m", mode, "-D", path_str(&data)]);
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

    /// Runs a Postgres binary, as the cluster owner when we are root.
    fn run(&self, program: &str, args: &[&str]) -> Output {
        let binary = self.bin_dir.join(program);
        let mut cmd = if running_as_root() {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", CLUSTER_OWNER, "--"]).arg(&binary);
            cmd
        } else {
            Command::new(&binary)
        };
        cmd.args(args)
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

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("scratch paths are UTF-8")
}
