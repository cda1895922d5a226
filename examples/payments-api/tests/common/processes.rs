//! The example service and the mirror writer as real processes (killed on
//! drop), for the chaos and partition tests: started on free ports, frozen
//! and thawed with SIGSTOP/SIGCONT; the writer also inside a network
//! namespace.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process with its log file; killed (and thawed first) on drop.
pub struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn spawn(name: &'static str, mut cmd: Command) -> Process {
        let log = idem_testkit::scratch_dir(name).join("log");
        let file = std::fs::File::create(&log).expect("create a process log");
        let child = cmd
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Process { name, child, log }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {}", self.name);
    }

    /// SIGSTOP: the process freezes (a GC pause, a VM stall).
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    /// SIGCONT.
    pub fn thaw(&self) {
        self.signal("CONT");
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-CONT")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = self.log.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Settings of one API process.
pub struct ApiOptions<'a> {
    pub redis_url: &'a str,
    pub database_url: &'a str,
    pub fence: bool,
    pub processor_delay: Duration,
    pub lease: Duration,
}

/// `payments-api` on a free port; returns once it answers HTTP.
pub async fn start_api(options: &ApiOptions<'_>) -> (Process, String) {
    let port = idem_testkit::free_port();
    let process = Process::spawn("payments-api", api_command(None, options, port));
    let base = format!("http://127.0.0.1:{port}");
    wait_for_api(&process, &base).await;
    (process, base)
}

/// `payments-api` inside `host` (its own network namespace, where it
/// listens on the host's 127.0.0.1), reached through a `Forward` from the
/// test's namespace; returns once it answers HTTP through it.
pub async fn start_api_in(
    host: &idem_testkit::netns::Host,
    options: &ApiOptions<'_>,
) -> (Process, idem_testkit::netns::Forward, String) {
    start_api_in_with(host, options, None).await
}

/// `start_api_in`, the API answering a stored response only once
/// `replica_ack` (replicas, timeout) acknowledged it (`REPLICA_ACK`; off
/// when `None`). Apart from `ApiOptions`, whose literals other tests write.
pub async fn start_api_in_with(
    host: &idem_testkit::netns::Host,
    options: &ApiOptions<'_>,
    replica_ack: Option<(u32, Duration)>,
) -> (Process, idem_testkit::netns::Forward, String) {
    let port = 8080;
    let mut cmd = api_command(Some(host.netns()), options, port);
    if let Some((replicas, timeout)) = replica_ack {
        cmd.env("REPLICA_ACK", format!("{replicas}:{}", timeout.as_millis()));
    }
    let process = Process::spawn("payments-api", cmd);
    let forward = host.forward(([127, 0, 0, 1], port).into());
    let base = format!("http://{}", forward.addr());
    wait_for_api(&process, &base).await;
    (process, forward, base)
}

fn api_command(netns: Option<&str>, options: &ApiOptions<'_>, port: u16) -> Command {
    let api = env!("CARGO_BIN_EXE_payments-api");
    let mut cmd = match netns {
        Some(netns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", netns, api]);
            cmd
        }
        None => Command::new(api),
    };
    cmd.env("REDIS_URL", options.redis_url)
        .env("DATABASE_URL", options.database_url)
        .env("PORT", port.to_string())
        .env("FENCE", if options.fence { "on" } else { "off" })
        .env("READ_THROUGH", "on")
        .env(
            "PROCESSOR_DELAY_MS",
            options.processor_delay.as_millis().to_string(),
        )
        .env("LEASE_MS", options.lease.as_millis().to_string())
        .env("PG_POOL_SIZE", "24")
        .env("RUST_LOG", "warn");
    cmd
}

async fn wait_for_api(process: &Process, base: &str) {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let probe = http
            .get(format!("{base}/payments/0"))
            .header("authorization", "Bearer tok_demo");
        if let Ok(reply) = probe.send().await {
            assert_eq!(reply.status(), 404, "a fresh API knows no payment 0");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "payments-api did not come up:\n{}",
            process.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `idem-writer` binary next to `payments-api` (the workspace build).
fn writer_binary() -> PathBuf {
    let api = Path::new(env!("CARGO_BIN_EXE_payments-api"));
    let writer = api.with_file_name("idem-writer");
    assert!(
        writer.exists(),
        "{} is missing: build the workspace (cargo build --release --workspace)",
        writer.display()
    );
    writer
}

/// `idem-writer run` mirroring `redis_url` into `database_url`.
pub fn start_writer(redis_url: &str, database_url: &str) -> Process {
    start_writer_in(None, &["--redis", redis_url], database_url)
}

/// `idem-writer run SOURCE... --database-url DATABASE_URL` inside network
/// namespace `netns` (`ip netns exec`, which runs it in place: signals
/// reach the writer), or here when `None`. `source`: `--redis URL,...` or
/// `--sentinel URL,... --service-name NAME`.
pub fn start_writer_in(netns: Option<&str>, source: &[&str], database_url: &str) -> Process {
    let mut cmd = match netns {
        Some(netns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", netns]).arg(writer_binary());
            cmd
        }
        None => Command::new(writer_binary()),
    };
    cmd.arg("run")
        .args(source)
        .args(["--database-url", database_url])
        .args(["--block-ms", "100", "--claim-ms", "2000", "--no-cleanup"])
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn");
    Process::spawn("idem-writer", cmd)
}
