//! Issue 28: a holder whose machine vanishes never blocks its key for long.
//!
//! Postgres runs in one network namespace, the holder (examples/fence_holder)
//! in another: it opens a transaction that holds a key's fence, then its
//! machine is taken off the network and the process killed, so no FIN ever
//! reaches Postgres and the session stays `idle in transaction` (server-side
//! keepalives would notice only after the kernel's two hours). A retry from
//! this test's namespace, over the bridge, must proceed within the lease
//! plus a few seconds: the fence's `idle_in_transaction_session_timeout`
//! ends the session. The same holder without it (`--no-idle-timeout`) keeps
//! the key `InFlight` and its session alive well past the lease: the
//! timeout, not something else, is what frees the key. Both shapes of the
//! fence: the claim inside the transaction (`in-tx`), and a committed claim
//! whose completion is left uncommitted (`phase2`). Skips (and says why)
//! where network namespaces cannot be made.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use idem_client::{Claim, Fence};
use idem_testkit::eventually_async;
use idem_testkit::netns::{Host, Net};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::Child;
use tokio::time::Instant;

/// The holders' lease (and so their idle timeout).
const LEASE: Duration = Duration::from_secs(2);
/// How soon after the holder vanished a retry must proceed.
const PROCEED_WITHIN: Duration = Duration::from_secs(LEASE.as_secs() + 3);
/// How long the holder without the idle timeout must keep its key.
const TEETH_WINDOW: Duration = Duration::from_secs(12);
/// Between a retry's claims.
const RETRY_EVERY: Duration = Duration::from_millis(200);
const TTL: Duration = Duration::from_secs(3600);
/// The request's fingerprint, the holder's and its retry's alike.
const FINGERPRINT: &str = "POST /payments {\"amount\":100}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_holder_of_a_claim_in_its_transaction_blocks_its_key_for_its_lease_only() {
    vanished_holder("in-tx").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_holder_of_an_uncommitted_completion_blocks_its_key_for_its_lease_only() {
    vanished_holder("phase2").await;
}

async fn vanished_holder(mode: &str) {
    let Some(mut net) = Net::new() else {
        eprintln!("skipping the {mode} holder: no network namespaces (see above)");
        return;
    };
    let db = net.host("db");
    let api = net.host("api");
    let bare_api = net.host("api-bare");
    let postgres = net.postgres(&db);
    let url = postgres.create_database("fence");
    let mut client = connect(&url).await;
    idem_writer::migrate(&mut client).await.expect("migrate");

    let binary = holder_binary();
    let holder = Holder::start(binary, &api, &url, mode, "protected", &[]).await;
    let bare = Holder::start(
        binary,
        &bare_api,
        &url,
        mode,
        "bare",
        &["--no-idle-timeout"],
    )
    .await;

    // The machines vanish: links down first, so the kill's FIN never leaves.
    net.cut(&api);
    net.cut(&bare_api);
    let vanished = Instant::now();
    holder.kill().await;
    bare.kill().await;
    for host in [&api, &bare_api] {
        assert_eq!(
            sessions(&client, host).await,
            ["idle in transaction"],
            "the session of {} after it vanished",
            host.name()
        );
    }

    let (answers, bare_answers) = tokio::join!(
        retry(&url, "protected", vanished, PROCEED_WITHIN, true),
        retry(&url, "bare", vanished, TEETH_WINDOW, false),
    );

    let Some(&(proceeded, Claim::Proceed)) = answers.last() else {
        panic!(
            "{mode}: no Proceed within {PROCEED_WITHIN:?} of the holder vanishing (lease \
             {LEASE:?}); its sessions by now {:?}; answers {answers:?}",
            sessions(&client, &api).await
        )
    };
    let ended = eventually_async(Duration::from_secs(1), || async {
        sessions(&client, &api).await.is_empty()
    })
    .await;
    assert!(
        ended,
        "{mode}: the retry proceeded, but Postgres kept the vanished session"
    );

    let not_in_flight: Vec<_> = bare_answers
        .iter()
        .filter(|(_, claim)| *claim != Claim::InFlight)
        .collect();
    assert!(
        not_in_flight.is_empty(),
        "{mode}: without the idle timeout the vanished holder's key was not kept: {not_in_flight:?}"
    );
    assert_eq!(
        sessions(&client, &bare_api).await,
        ["idle in transaction"],
        "{mode}: without the idle timeout the session must outlive {TEETH_WINDOW:?}"
    );
    eprintln!(
        "{mode}: the retry proceeded {:.2} s after the holder vanished (lease {LEASE:?}); \
         without the idle timeout {} claims over {TEETH_WINDOW:?} all answered InFlight \
         and the session stayed idle in transaction",
        proceeded.as_secs_f64(),
        bare_answers.len()
    );
}

/// A `fence_holder` process inside a host's namespace, killed on drop.
struct Holder {
    child: Child,
}

impl Holder {
    /// Starts the holder of `key` (token 1) in `mode` with `flags` inside
    /// `host`, and waits for its `ready`: its open transaction holds the key.
    async fn start(
        binary: &Path,
        host: &Host,
        url: &str,
        mode: &str,
        key: &str,
        flags: &[&str],
    ) -> Holder {
        let lease_ms = LEASE.as_millis().to_string();
        let mut command = host.command(binary);
        command
            .args([mode, key, "1"])
            .arg(FINGERPRINT)
            .args(["--lease-ms", &lease_ms])
            .args(flags)
            .env("DATABASE_URL", url)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = tokio::process::Command::from(command)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        let read = tokio::time::timeout(
            Duration::from_secs(20),
            BufReader::new(stdout).read_line(&mut line),
        )
        .await;
        if !matches!(read, Ok(Ok(_))) || line.trim() != "ready" {
            let _ = child.start_kill();
            let mut stderr = String::new();
            if let Some(mut err) = child.stderr.take() {
                let _ = err.read_to_string(&mut stderr).await;
            }
            panic!(
                "the {mode} holder of {key} in {} not ready ({read:?}, {line:?}):\n{stderr}",
                host.name()
            );
        }
        Holder { child }
    }

    /// SIGKILL, as a machine's sudden death would end it.
    async fn kill(mut self) {
        self.child.start_kill().expect("kill the holder");
        self.child.wait().await.expect("reap the holder");
    }
}

/// The client's retry: claims `key` (a larger token, the holder's
/// fingerprint) every `RETRY_EVERY` until `window` after `vanished` has
/// passed or, with `until_proceed`, a claim proceeds. Each answer with when
/// it came, since `vanished`.
async fn retry(
    url: &str,
    key: &str,
    vanished: Instant,
    window: Duration,
    until_proceed: bool,
) -> Vec<(Duration, Claim)> {
    let mut client = connect(url).await;
    let fence = Fence::new(key, 2, FINGERPRINT.as_bytes(), TTL).with_lease(LEASE);
    let mut answers = Vec::new();
    while vanished.elapsed() < window {
        let claim = tokio::time::timeout(Duration::from_secs(2), fence.claim(&mut client))
            .await
            .unwrap_or_else(|_| panic!("a claim of {key} took over 2 s"))
            .unwrap_or_else(|e| panic!("claim {key}: {e}"));
        let proceeded = claim == Claim::Proceed;
        answers.push((vanished.elapsed(), claim));
        if proceeded && until_proceed {
            break;
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
    answers
}

/// The states of `host`'s sessions, as Postgres sees them.
async fn sessions(client: &tokio_postgres::Client, host: &Host) -> Vec<String> {
    let addr = IpAddr::from(host.ip());
    client
        .query(
            "SELECT state FROM pg_stat_activity WHERE client_addr = $1",
            &[&addr],
        )
        .await
        .expect("read pg_stat_activity")
        .iter()
        .map(|row| row.get::<_, Option<String>>(0).unwrap_or_default())
        .collect()
}

/// A tokio-postgres connection from this test's namespace, over the bridge.
async fn connect(url: &str) -> tokio_postgres::Client {
    let mut config: tokio_postgres::Config = url.parse().expect("a postgres URL");
    config.connect_timeout(Duration::from_secs(3));
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    tokio::spawn(connection);
    client
}

/// examples/fence_holder: `$IDEM_FENCE_HOLDER` when set (scripts/test.sh
/// points it at the workspace build's copy, so no cargo runs while other
/// parts hold the build directory's lock), else built once per run for
/// this test's profile (`cargo test --test` builds no examples).
fn holder_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        if let Some(binary) = std::env::var_os("IDEM_FENCE_HOLDER") {
            let binary = PathBuf::from(binary);
            assert!(
                binary.exists(),
                "IDEM_FENCE_HOLDER={} does not exist",
                binary.display()
            );
            return binary;
        }
        let exe = std::env::current_exe().expect("the test's path");
        // TARGET_DIR/PROFILE/deps/TEST
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("the test runs from TARGET_DIR/PROFILE/deps");
        let target_dir = profile_dir.parent().expect("a target directory");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev",
            Some(name) => name,
            None => panic!("no profile in {}", exe.display()),
        };
        let status = std::process::Command::new(env!("CARGO"))
            .args([
                "build",
                "-q",
                "-p",
                "idem-client",
                "--example",
                "fence_holder",
            ])
            .args(["--features", "postgres", "--profile", profile])
            .arg("--target-dir")
            .arg(target_dir)
            .status()
            .expect("run cargo");
        assert!(
            status.success(),
            "cargo build --example fence_holder: {status}"
        );
        let binary = profile_dir.join("examples").join("fence_holder");
        assert!(binary.exists(), "{} not built", binary.display());
        binary
    })
}
