//! The writer following a Sentinel-managed primary (`--sentinel`,
//! `--service-name`) without a restart: the primary is killed with SIGKILL,
//! three sentinels promote its replica, and every surviving record is
//! mirrored once; with a fixed `--redis` of the old primary (teeth) the
//! promoted replica's records stay unmirrored. One test at a time.

mod common;

use std::time::Duration;

use common::failover::*;
use common::*;
use idem_testkit::cluster::{connect_local, sentinel_primary_port, SentinelSetup};
use idem_testkit::{eventually, PgDatabase};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const SERVICE: &str = "idem";

struct Sentinels(SentinelSetup);

impl FailoverSetup for Sentinels {
    fn replica_pending(&mut self) -> i64 {
        info_field(&mut self.0.replica.conn(), "idem_mirror_pending")
    }

    fn fail_over(&mut self) {
        self.0.primary.kill();
        let replica = self.0.replica.port;
        let switched = eventually(Duration::from_secs(30), || {
            self.0.agreed_primary_port() == Some(replica)
        });
        assert!(
            switched,
            "the sentinels did not promote the replica:\n{}",
            self.0.sentinels[0].log()
        );
    }

    fn pending_on_primaries(&mut self) -> i64 {
        info_field(&mut self.0.replica.conn(), "idem_mirror_pending")
    }
}

/// The primary's port as the first sentinel that answers names it.
fn sentinel_route(sentinel_ports: Vec<u16>) -> Route {
    Box::new(move |_shard| {
        let port = sentinel_ports
            .iter()
            .find_map(|port| sentinel_primary_port(*port, SERVICE))?;
        connect_local(port).map(|c| (port, c))
    })
}

async fn sentinel_run(follow: bool) -> Run {
    let setup = SentinelSetup::start(SERVICE, 3, 1000);
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let sentinels = setup.sentinel_urls().join(",");
    let primary_url = setup.primary.url();
    let args: Vec<&str> = if follow {
        vec!["--sentinel", &sentinels, "--service-name", SERVICE]
    } else {
        vec!["--redis", &primary_url]
    };
    let writer = WriterProcess::start(
        &[],
        &db.url,
        &[
            &args[..],
            &["--batch-size", "100", "--shutdown-grace", "3s"],
        ]
        .concat(),
    );
    let ports = (setup.primary.port, setup.replica.port);
    let route = sentinel_route(setup.sentinels.iter().map(|s| s.port).collect());
    drive(
        &mut Sentinels(setup),
        writer,
        &db.url,
        vec!["tenant".to_string()],
        route,
        follow,
        ports,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_follows_a_sentinel_failover() {
    let _serial = SERIAL.lock().await;
    let mut run = sentinel_run(true).await;
    assert_followed(&mut run);
}

/// Teeth: the same failover with the old primary as a fixed `--redis`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_following_a_sentinel_failover_strands_records() {
    let _serial = SERIAL.lock().await;
    let run = sentinel_run(false).await;
    assert_stranded(&run);
}
