//! A `redis-server` as a managed service runs it, for the Functions
//! library's tests (functions/idem.lua): no module loaded, and `MODULE`,
//! `DEBUG` and `CONFIG` renamed away, as a managed Redis refuses them.
//! Killed and its directory removed on drop, like `RedisServer`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{eventually, free_port, lost_port, scratch_dir, server_binary};

/// The commands a managed service refuses (renamed to nothing).
pub const REFUSED: [&str; 3] = ["MODULE", "DEBUG", "CONFIG"];

/// A running `redis-server` without the module.
pub struct ManagedServer {
    pub port: u16,
    pub dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl ManagedServer {
    /// Starts a server with `REFUSED` renamed away and `args` (server
    /// options as on the command line: `["--maxmemory", "10mb"]`).
    pub fn start(args: &[&str]) -> Self {
        let mut server = ManagedServer {
            port: free_port(),
            dir: scratch_dir("managed"),
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        for attempt in 1..=5 {
            match server.try_spawn() {
                Ok(()) => return server,
                Err(log) if attempt < 5 && lost_port(&log, server.port) => {
                    server.port = free_port()
                }
                Err(log) => panic!("redis-server exited; log:\n{log}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// A replica of `primary` (same options), returned once its link is up.
    pub fn start_replica_of(primary: &ManagedServer) -> Self {
        let port = primary.port.to_string();
        let mut args: Vec<&str> = primary.args.iter().map(String::as_str).collect();
        args.extend(["--replicaof", "127.0.0.1", &port]);
        let replica = ManagedServer::start(&args);
        let mut conn = replica.conn();
        let synced = eventually(Duration::from_secs(20), || {
            crate::cluster::info(&mut conn, "replication")
                .get("master_link_status")
                .map(String::as_str)
                == Some("up")
        });
        assert!(synced, "the replica did not sync:\n{}", replica.log());
        replica
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let mut cmd = Command::new(server_binary());
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(["--repl-diskless-sync-delay", "0"]);
        for name in REFUSED {
            cmd.args(["--rename-command", name, ""]);
        }
        cmd.args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("spawn redis-server (is it installed?)"));
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

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }
}

impl Drop for ManagedServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
