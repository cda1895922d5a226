//! Holds one key's fence in an open transaction, then never moves again:
//! the API process of tests/fence_vanished_holder.rs, whose machine the
//! test takes off the network and whose process it kills.
//!
//! ```text
//! DATABASE_URL=postgres://... fence_holder MODE KEY TOKEN FINGERPRINT [--lease-ms N] [--no-idle-timeout]
//! ```
//!
//! MODE `in-tx`: BEGIN, claim inside the transaction (`claim_in`). MODE
//! `phase2`: a durable claim (`claim`, committed), then BEGIN and write the
//! response (`complete`) without committing. Either way the transaction
//! stays open holding the key: it prints `ready` and sleeps. `--lease-ms`
//! sets the fence's lease (default 30000), `--no-idle-timeout` leaves the
//! session's `idle_in_transaction_session_timeout` alone (off by default).

use std::error::Error;
use std::time::Duration;

use idem_client::{Claim, Commit, Fence, StoredResponse};
use tokio::io::AsyncWriteExt;

/// How long the key's row lives once completed.
const TTL: Duration = Duration::from_secs(3600);

const USAGE: &str = "usage: fence_holder in-tx|phase2 KEY TOKEN FINGERPRINT \
                     [--lease-ms N] [--no-idle-timeout]  (DATABASE_URL in the environment)";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The claim inside the open transaction.
    InTx,
    /// A committed claim, then the completion in the open transaction.
    Phase2,
}

#[derive(Debug)]
struct Args {
    mode: Mode,
    key: String,
    token: u64,
    fingerprint: String,
    lease: Duration,
    idle_timeout: bool,
}

impl Args {
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
        let mut positional = Vec::new();
        let (mut lease, mut idle_timeout) = (Duration::from_secs(30), true);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--lease-ms" => {
                    let ms = args.next().ok_or("--lease-ms needs a value")?;
                    let ms = ms.parse().map_err(|e| format!("--lease-ms {ms}: {e}"))?;
                    lease = Duration::from_millis(ms);
                }
                "--no-idle-timeout" => idle_timeout = false,
                flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}")),
                _ => positional.push(arg),
            }
        }
        let [mode, key, token, fingerprint] = <[String; 4]>::try_from(positional)
            .map_err(|got| format!("want 4 arguments, got {}", got.len()))?;
        let mode = match mode.as_str() {
            "in-tx" => Mode::InTx,
            "phase2" => Mode::Phase2,
            other => return Err(format!("unknown MODE {other}")),
        };
        let token = token.parse().map_err(|e| format!("TOKEN {token}: {e}"))?;
        Ok(Args {
            mode,
            key,
            token,
            fingerprint,
            lease,
            idle_timeout,
        })
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse(std::env::args().skip(1)).map_err(|e| format!("{e}\n{USAGE}"))?;
    let url = std::env::var("DATABASE_URL").map_err(|_| format!("DATABASE_URL unset\n{USAGE}"))?;
    let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("connect to {url}: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("connection: {e}");
        }
    });

    let fence =
        Fence::new(&args.key, args.token, args.fingerprint.as_bytes(), TTL).with_lease(args.lease);
    let fence = if args.idle_timeout {
        fence
    } else {
        fence.with_idle_timeout(None)
    };

    let tx = match args.mode {
        Mode::InTx => {
            let tx = client.transaction().await?;
            expect_proceed(fence.claim_in(&tx).await?)?;
            tx
        }
        Mode::Phase2 => {
            expect_proceed(fence.claim(&mut client).await?)?;
            let tx = client.transaction().await?;
            let response = StoredResponse::new(201, format!("{{\"token\":{}}}", args.token));
            match fence.complete(&tx, &response).await? {
                Commit::Committed => {}
                Commit::Lost(claim) => return Err(format!("lost the key: {claim:?}").into()),
            }
            tx
        }
    };

    let mut stdout = tokio::io::stdout();
    stdout.write_all(b"ready\n").await?;
    stdout.flush().await?;
    // Sleeps, the transaction open, until the process is killed.
    let _open = tx;
    std::future::pending().await
}

fn expect_proceed(claim: Claim) -> Result<(), String> {
    match claim {
        Claim::Proceed => Ok(()),
        other => Err(format!("claim answered {other:?}, not Proceed")),
    }
}
