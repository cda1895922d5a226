//! 1,000 duplicates waiting on one key on the Functions library, whose wait
//! is a poll (docs/client.md, "Backends"): prints the time from the
//! holder's completion to the last waiter's answer. Starts its own
//! `redis-server` (without the module) on a free port and stops it.
//!
//! `cargo run --release -p idem-client --example library_waiters [WAITERS]`

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idem_client::{Backend, BeginOptions, IdemClient, Origin, Outcome, StoredResponse, Transport};

/// How long the whole run may take before it gives up.
const BOUND: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let waiters: usize = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 1000,
    };
    let port = idem_testkit::free_port();
    let dir = idem_testkit::scratch_dir("library-waiters");
    let mut server = Command::new(idem_testkit::server_binary())
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let result = tokio::time::timeout(BOUND, run(port, waiters)).await;
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Ok(result) => result,
        Err(_) => Err(format!("gave up after {BOUND:?}").into()),
    }
}

async fn run(port: u16, waiters: usize) -> Result<(), Box<dyn std::error::Error>> {
    let redis = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let ready = Instant::now() + Duration::from_secs(10);
    let client = loop {
        match IdemClient::standalone_using(redis.clone(), Transport::Auto, Backend::Functions).await
        {
            Ok(client) => break client,
            Err(_) if Instant::now() < ready => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(err) => return Err(err.into()),
        }
    };
    let options = BeginOptions::new(Duration::from_secs(600));
    let key = "bench:{waiters}";
    let Outcome::New { token } = client.begin(key, b"fp", options).await? else {
        return Err("the key was not new".into());
    };
    let wait = options.wait(Duration::from_secs(30));
    let tasks: Vec<_> = (0..waiters)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                let outcome = client.begin(key, b"fp", wait).await;
                (outcome, Instant::now())
            })
        })
        .collect();
    // Every waiter polling by now, at its longest pause.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let response = StoredResponse::new(201, "created");
    client
        .complete(key, token, &response, Origin::Handler)
        .await?;
    let completed = Instant::now();
    let mut last = completed;
    let mut replays = 0;
    for task in tasks {
        let (outcome, at) = task.await?;
        if outcome? == Outcome::Replay(response.clone()) {
            replays += 1;
        }
        last = last.max(at);
    }
    println!(
        "{waiters} waiters on one key (library backend): {replays} replays; last answer {:.1} ms after the completion",
        last.duration_since(completed).as_secs_f64() * 1000.0
    );
    Ok(())
}
