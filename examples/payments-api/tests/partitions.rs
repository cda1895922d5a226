//! Partition test (issue 31): the example API and the writer as processes,
//! Redis (with replicas and Sentinels) and Postgres (with a standby) each in
//! a network namespace of its own on a private bridge, a nemesis that
//! partitions, kills and promotes, and clients whose every request goes into
//! a checked history. Each scenario asserts what its settings promise and,
//! with weaker settings, the loss it measures (the teeth). Skips, saying
//! so, where namespaces cannot be made. Each API instance runs in a host of
//! its own, listening on that host's 127.0.0.1; the clients reach it through
//! a relay from the test's namespace (`Host::forward`) that no partition of
//! the host touches.

mod common;
#[path = "partitions/lab.rs"]
mod lab;

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use common::processes::{start_api_in, start_api_in_with, start_writer_in, ApiOptions};
use idem_testkit::history::{check, unkept_answers, Report};
use idem_testkit::nemesis::{Fault, Nemesis, Side};
use idem_testkit::partition::{serve_replication, NsRedis, NsSentinel, PgStandby, Replication};
use lab::{collect, read_write_url, settle, Clients};

/// How long the writer gets, after healing, to mirror everything.
const WRITER_TIME: Duration = Duration::from_secs(20);

fn no_hook(fault: &Fault) {
    panic!("this scenario kills and promotes by itself, not through {fault}");
}

// ---------------------------------------------------------------------------
// (d) Postgres: the primary isolated from its standby, then lost; the
// standby promoted.

/// What a promotion run measured.
struct Promotion {
    report: Report,
    /// After `idem remirror --since` (from before the standby was cut
    /// off), run twice: the history checked again.
    remirrored: Report,
    /// The two runs' outputs.
    remirror_runs: [String; 2],
}

/// Keys 0..4 are paid while the standby keeps up; then the primary is
/// partitioned from its standby and keys 4..14 are sent; 2 s later the
/// primary dies (`pg_ctl stop -m immediate`) and the standby is promoted;
/// the clients carry on against `target_session_attrs=read-write` URLs, and
/// then every key is sent once more (a client that lost its answer).
async fn postgres_promotion(
    scenario: &'static str,
    mode: Replication,
    fence: bool,
) -> Option<Promotion> {
    let start = std::time::Instant::now();
    let phase =
        |what: &str| eprintln!("{scenario} {:>6.1}s: {what}", start.elapsed().as_secs_f64());
    let mut net = lab::net(scenario)?;
    let (pg1, pg2) = (net.host("pg1"), net.host("pg2"));
    let (redis_host, writer_host) = (net.host("redis"), net.host("writer"));
    let api_host = net.host("api");
    let mut primary = lab::postgres(&net, &pg1);
    serve_replication(&net, &primary, mode);
    let standby = PgStandby::start(&pg2, &pg1, &primary);
    let redis = NsRedis::primary(&redis_host, &[]);
    let url = read_write_url(&[&pg1, &pg2], primary.port);
    let options = ApiOptions {
        redis_url: &redis.url(),
        database_url: &url,
        fence,
        processor_delay: Duration::from_millis(200),
        lease: Duration::from_secs(3),
    };
    phase("servers up");
    let (api, _forward, base) = start_api_in(&api_host, &options).await;
    let writer = start_writer_in(Some(writer_host.netns()), &["--redis", &redis.url()], &url);
    let mut nemesis = Nemesis::new(&net, 0);
    let clients = Clients::new(scenario, Duration::from_secs(5));
    let bases = [base];

    collect(clients.spawn(&bases, 0..4, Duration::from_secs(20))).await;
    phase("keys 0..4 paid");
    let held_since = SystemTime::now();
    let hold = Fault::Partition {
        a: vec![(&pg1).into()],
        b: vec![(&pg2).into()],
    };
    nemesis.apply(&hold, &mut no_hook);
    let window = clients.spawn(&bases, 4..14, Duration::from_secs(45));
    tokio::time::sleep(Duration::from_secs(2)).await;
    primary.kill();
    nemesis.heal();
    standby.promote();
    phase("primary killed, standby promoted");
    collect(window).await;
    phase("window's clients done");
    collect(clients.spawn(&bases, 0..14, Duration::from_secs(20))).await;

    phase("replays done");
    let promoted = read_write_url(&[&pg2], standby.port);
    // The writer's time: it mirrors a completion within a second here.
    let observed = settle(
        scenario,
        0..14,
        &promoted,
        &[&redis],
        Duration::from_secs(8),
    )
    .await;
    phase("settled");
    let report = check(&clients.history.requests(), &observed);
    println!("{scenario} ({mode:?}, fence {fence}): {report}");
    if !report.unanswered.is_empty() {
        lab::explain(&clients, &api.log());
    }
    let remirror_runs = [
        lab::remirror(held_since, &redis.url(), &promoted),
        lab::remirror(held_since, &redis.url(), &promoted),
    ];
    let observed = lab::observe(scenario, 0..14, &promoted, &[&redis]).await;
    let remirrored = check(&clients.history.requests(), &observed);
    println!("{scenario} after idem remirror: {remirrored}");
    drop((api, writer));
    Some(Promotion {
        report,
        remirrored,
        remirror_runs,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_standby_held_behind_and_promoted_loses_acknowledged_payments() {
    let Some(run) = postgres_promotion("pgasync", Replication::Asynchronous, true).await else {
        return;
    };
    let report = &run.report;
    // The teeth: the window's commits never reached the standby.
    assert!(
        !report.lost.is_empty(),
        "no acknowledged payment lost: {report}"
    );
    // The writer had mirrored them into the lost primary too: Redis says
    // mirrored, the promoted standby has no row.
    assert!(
        !report.unmirrored.is_empty(),
        "no mirror row lost: {report}"
    );
    // The fence still never runs a payment twice, and nobody saw two ids.
    assert!(
        report.doubled.is_empty() && report.double_charged.is_empty(),
        "{report}"
    );
    assert!(report.contradicting.is_empty(), "{report}");
    assert!(report.unanswered.is_empty(), "{report}");
    // The operator closes the mirror's window: `idem remirror --since`
    // writes back the completions Redis still holds; a second run changes
    // nothing. The payments themselves stay lost: only the answers return.
    let after = &run.remirrored;
    assert!(
        after.unmirrored.is_empty(),
        "after remirror: {after}\n{:?}",
        run.remirror_runs
    );
    assert_eq!(after.lost, report.lost, "remirror restores no payment");
    assert!(
        run.remirror_runs[1].contains(" 0 written"),
        "a second remirror wrote again: {}",
        run.remirror_runs[1]
    );
    println!(
        "idem remirror, twice:\n{}\n{}",
        run.remirror_runs[0], run.remirror_runs[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_standby_promoted_loses_no_acknowledged_payment() {
    let Some(run) = postgres_promotion("pgsync", Replication::Synchronous, true).await else {
        return;
    };
    let report = &run.report;
    assert!(report.is_clean(), "{report}");
    assert!(report.unanswered.is_empty(), "{report}");
}

// ---------------------------------------------------------------------------
// (b) The API cut off from Postgres in the middle of its requests.

/// Ten keys with a 1 s processor call and a 2 s lease; 300 ms in (inside
/// the processor call, the durable claim committed), the API's host loses
/// Postgres both ways for 4 s, beyond the lease; 2.5 s in a second client
/// per key retries. Redis and the writer stay reachable.
async fn api_cut_from_postgres(scenario: &'static str, fence: bool) -> Option<Report> {
    let mut net = lab::net(scenario)?;
    let (pg_host, redis_host, writer_host) =
        (net.host("pg"), net.host("redis"), net.host("writer"));
    let api_host = net.host("api");
    let postgres = lab::postgres(&net, &pg_host);
    let redis = NsRedis::primary(&redis_host, &[]);
    let url = read_write_url(&[&pg_host], postgres.port);
    let options = ApiOptions {
        redis_url: &redis.url(),
        database_url: &url,
        fence,
        processor_delay: Duration::from_millis(1000),
        lease: Duration::from_secs(2),
    };
    let (api, _forward, base) = start_api_in(&api_host, &options).await;
    let writer = start_writer_in(Some(writer_host.netns()), &["--redis", &redis.url()], &url);
    let mut nemesis = Nemesis::new(&net, 0);
    let clients = Clients::new(scenario, Duration::from_secs(15));
    let bases = [base];

    let originals = clients.spawn(&bases, 0..10, Duration::from_secs(40));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cut = Fault::Partition {
        a: vec![(&api_host).into()],
        b: vec![(&pg_host).into()],
    };
    nemesis.apply(&cut, &mut no_hook);
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let retries = clients.spawn(&bases, 0..10, Duration::from_secs(40));
    tokio::time::sleep(Duration::from_millis(1800)).await;
    nemesis.heal();
    collect(originals).await;
    collect(retries).await;

    let observed = settle(scenario, 0..10, &url, &[&redis], WRITER_TIME).await;
    let report = check(&clients.history.requests(), &observed);
    println!("{scenario} (fence {fence}): {report}");
    drop((api, writer));
    Some(report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_cut_off_from_postgres_mid_request_pays_once_with_the_fence() {
    let Some(fenced) = api_cut_from_postgres("apicut", true).await else {
        return;
    };
    assert!(fenced.is_clean(), "with the fence: {fenced}");
    assert!(fenced.unanswered.is_empty(), "with the fence: {fenced}");
    // Without the fence: measured and reported (docs/partitions.md), the
    // promise being the fence's.
    if let Some(unfenced) = api_cut_from_postgres("apicutnf", false).await {
        println!("without the fence: {unfenced}");
    }
}

// ---------------------------------------------------------------------------
// (c) The writer cut off from one of two Redis nodes, then healed.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_cut_off_from_one_node_mirrors_everything_once_healed() {
    let scenario = "writercut";
    let Some(mut net) = lab::net(scenario) else {
        return;
    };
    let (pg_host, r1, r2, writer_host) = (
        net.host("pg"),
        net.host("r1"),
        net.host("r2"),
        net.host("writer"),
    );
    let (api1_host, api2_host) = (net.host("api1"), net.host("api2"));
    let postgres = lab::postgres(&net, &pg_host);
    let (one, two) = (NsRedis::primary(&r1, &[]), NsRedis::primary(&r2, &[]));
    let url = read_write_url(&[&pg_host], postgres.port);
    // Without the fence: with it the API writes each key's completed row
    // itself, and only the writer's mirror is under test here.
    let options = |redis_url| ApiOptions {
        redis_url,
        database_url: &url,
        fence: false,
        processor_delay: Duration::ZERO,
        lease: Duration::from_secs(5),
    };
    let (one_url, two_url) = (one.url(), two.url());
    let (api1, _forward1, base1) = start_api_in(&api1_host, &options(&one_url)).await;
    let (api2, _forward2, base2) = start_api_in(&api2_host, &options(&two_url)).await;
    let source = format!("{one_url},{two_url}");
    let writer = start_writer_in(Some(writer_host.netns()), &["--redis", &source], &url);
    let mut nemesis = Nemesis::new(&net, 0);
    let clients = Clients::new(scenario, Duration::from_secs(5));

    let cut = Fault::Partition {
        a: vec![(&writer_host).into()],
        b: vec![(&r2).into()],
    };
    nemesis.apply(&cut, &mut no_hook);
    // Even keys through node one, odd through node two.
    collect(clients.spawn(&[base1, base2], 0..12, Duration::from_secs(20))).await;
    let during = settle(scenario, 0..12, &url, &[&one, &two], Duration::from_secs(3)).await;
    let behind: Vec<String> = during
        .redis_completed
        .difference(&during.mirrored)
        .cloned()
        .collect();
    let odd: Vec<String> = (0..12)
        .filter(|i| i % 2 == 1)
        .map(|i| lab::key(scenario, i))
        .collect();
    // The cut bites: node two's completions wait; node one's do not.
    assert_eq!(
        behind,
        odd,
        "during the cut: {during:?}\nwriter log:\n{}",
        writer.log()
    );

    nemesis.heal();
    let after = settle(scenario, 0..12, &url, &[&one, &two], WRITER_TIME).await;
    let report = check(&clients.history.requests(), &after);
    println!(
        "{scenario}: during the cut {} unmirrored; healed: {report}",
        behind.len()
    );
    assert!(report.is_clean(), "{report}\nwriter log:\n{}", writer.log());
    assert!(report.unanswered.is_empty(), "{report}");
    drop((api1, api2, writer));
}

// ---------------------------------------------------------------------------
// (a) Split brain: the Redis primary isolated from its replica and the
// Sentinels (and the writer) while the API still reaches it.

/// What a split-brain run measured.
struct SplitBrain {
    report: Report,
    /// Keys whose 2xx came from the isolated primary and that the promoted
    /// replica does not hold as completed once healed: Redis's lost answers.
    redis_lost: usize,
    /// Answers during the partition that were not 2xx (unavailability).
    refused: usize,
    /// Keys answered 2xx during the partition.
    acknowledged: usize,
}

/// The settings of a split-brain run.
#[derive(Clone, Copy)]
struct SplitSettings {
    fence: bool,
    /// `min-replicas-to-write 1`, `min-replicas-max-lag 1` on both servers.
    min_replicas: bool,
    /// The API's `REPLICA_ACK`: one replica within this timeout.
    replica_ack: Option<Duration>,
}

/// Primary, replica, three Sentinels (quorum 2, down after 1 s) and the
/// writer (following the Sentinels), each in a host; the API talks to the
/// primary directly (the example has no Sentinel support). Keys 0..2 are
/// paid; the primary is partitioned from the rest but the API; keys 2..12
/// are sent over 4 s; the Sentinels promote the replica; the partition
/// heals and the old primary becomes a replica (its writes discarded); the
/// API is restarted against the new primary (a Sentinel-aware client would
/// follow) and every key is sent again. With a replica ack, each client
/// during the partition waits out the ack (its request timeout is the ack's
/// plus 2 s) and retries for 6 s, so replays of what the isolated primary
/// stored are tried too.
async fn split_brain(scenario: &'static str, settings: SplitSettings) -> Option<SplitBrain> {
    let SplitSettings {
        fence,
        min_replicas,
        replica_ack,
    } = settings;
    const NAME: &str = "idem";
    let mut net = lab::net(scenario)?;
    let (pg_host, r1, r2) = (net.host("pg"), net.host("r1"), net.host("r2"));
    let sentinel_hosts = [net.host("s1"), net.host("s2"), net.host("s3")];
    let (writer_host, api_host) = (net.host("writer"), net.host("api"));
    let postgres = lab::postgres(&net, &pg_host);
    let args: &[&str] = if min_replicas {
        &[
            "--min-replicas-to-write",
            "1",
            "--min-replicas-max-lag",
            "1",
        ]
    } else {
        &[]
    };
    let primary = NsRedis::primary(&r1, args);
    let replica = NsRedis::replica(&r2, &primary, args);
    let sentinels: Vec<NsSentinel> = sentinel_hosts
        .iter()
        .map(|h| NsSentinel::start(h, NAME, &primary, 2, Duration::from_secs(1)))
        .collect();
    let know_all = idem_testkit::eventually(Duration::from_secs(20), || {
        sentinels.iter().all(|s| s.others(NAME) == 2)
    });
    assert!(know_all, "the sentinels never met");
    let url = read_write_url(&[&pg_host], postgres.port);
    let primary_url = primary.url();
    let options = |redis_url| ApiOptions {
        redis_url,
        database_url: &url,
        fence,
        processor_delay: Duration::from_millis(100),
        lease: Duration::from_secs(5),
    };
    let ack = replica_ack.map(|timeout| (1, timeout));
    let (api, forward, base) = start_api_in_with(&api_host, &options(&primary_url), ack).await;
    let sentinel_urls: Vec<String> = sentinels.iter().map(NsSentinel::url).collect();
    let writer = start_writer_in(
        Some(writer_host.netns()),
        &[
            "--sentinel",
            &sentinel_urls.join(","),
            "--service-name",
            NAME,
        ],
        &url,
    );
    let mut nemesis = Nemesis::new(&net, 0);
    let (request_timeout, patience) = match replica_ack {
        Some(ack) => (ack + Duration::from_secs(2), Duration::from_secs(6)),
        None => (Duration::from_secs(3), Duration::from_secs(2)),
    };
    let clients = Clients::new(scenario, request_timeout);

    collect(clients.spawn(std::slice::from_ref(&base), 0..2, Duration::from_secs(20))).await;
    let mut rest: Vec<Side> = vec![(&r2).into()];
    rest.extend(sentinel_hosts.iter().map(Side::from));
    nemesis.apply(
        &Fault::Partition {
            a: vec![(&r1).into()],
            b: rest,
        },
        &mut no_hook,
    );
    // The writer is on the majority's side, and stays cut off from the old
    // primary until it has been demoted: else its stalled pull could still
    // mirror the old primary's completions when the network heals.
    let mut writer_side = Nemesis::new(&net, 0);
    writer_side.apply(
        &Fault::Partition {
            a: vec![(&r1).into()],
            b: vec![(&writer_host).into()],
        },
        &mut no_hook,
    );
    let before = clients.history.requests().len();
    // One key every 400 ms for 4 s, each client patient for 2 s (6 s with
    // the replica ack).
    let gap = Duration::from_millis(400);
    collect(clients.spawn_staggered(&[base], 2..12, gap, patience)).await;
    let during = clients.history.requests()[before..].to_vec();
    let refused = during
        .iter()
        .filter(|r| !matches!(r.answer, idem_testkit::history::Answer::Paid { .. }))
        .count();
    let promoted = idem_testkit::eventually(Duration::from_secs(20), || {
        sentinels
            .iter()
            .filter(|s| s.primary_addr(NAME) == Some(r2.ip()))
            .count()
            >= 2
    });
    assert!(
        promoted,
        "the sentinels never promoted the replica:\n{}",
        sentinels[0].log()
    );
    nemesis.heal();
    let demoted = idem_testkit::eventually(Duration::from_secs(30), || {
        primary.role().as_deref() == Some("slave")
            && primary
                .info("replication")
                .get("master_link_status")
                .map(String::as_str)
                == Some("up")
    });
    assert!(
        demoted,
        "the old primary never rejoined as a replica:\n{}",
        primary.log()
    );
    writer_side.heal();

    // What the promoted replica holds before any client comes back.
    let kept = lab::observe(scenario, 0..12, &url, &[&replica])
        .await
        .redis_completed;
    let acknowledged = unkept_answers(&during, &BTreeSet::new()).len();
    let redis_lost = unkept_answers(&during, &kept).len();

    drop((api, forward));
    let replica_url = replica.url();
    let (api, _forward, base) = start_api_in_with(&api_host, &options(&replica_url), ack).await;
    collect(clients.spawn(&[base], 0..12, Duration::from_secs(20))).await;
    let observed = settle(scenario, 0..12, &url, &[&replica], WRITER_TIME).await;
    let report = check(&clients.history.requests(), &observed);
    println!(
        "{scenario} (fence {fence}, min-replicas {min_replicas}, replica ack {replica_ack:?}): \
         {acknowledged} keys acknowledged during the partition, Redis lost {redis_lost} of them, \
         {refused} requests refused during the partition; {report}"
    );
    if !report.unanswered.is_empty() {
        lab::explain(&clients, &api.log());
    }
    drop((api, writer));
    Some(SplitBrain {
        report,
        redis_lost,
        refused,
        acknowledged,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_brain_loses_redis_answers_but_the_fence_pays_once() {
    let Some(fenced) = split_brain("splitf", UNSAFE).await else {
        return;
    };
    // The isolated primary acknowledged completions the promoted replica
    // never got: measured, > 0 (the classic split brain).
    assert!(
        fenced.redis_lost > 0,
        "no answer lost in Redis: {}",
        fenced.report
    );
    assert!(
        fenced.report.is_clean(),
        "with the fence: {}",
        fenced.report
    );
    assert!(fenced.report.unanswered.is_empty(), "{}", fenced.report);

    // The teeth: without the fence the retries of the lost answers pay again.
    let unfenced = split_brain(
        "splitnf",
        SplitSettings {
            fence: false,
            ..UNSAFE
        },
    )
    .await
    .expect("a net");
    assert!(unfenced.redis_lost > 0, "{}", unfenced.report);
    assert!(
        !unfenced.report.doubled.is_empty(),
        "without the fence: {}",
        unfenced.report
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_replicas_to_write_refuses_the_isolated_primary() {
    let Some(run) = split_brain(
        "splitmr",
        SplitSettings {
            min_replicas: true,
            ..UNSAFE
        },
    )
    .await
    else {
        return;
    };
    // What min-replicas-to-write buys: the isolated primary stops taking
    // writes once its replica's lag passes 1 s (unavailability instead of
    // acknowledged answers that vanish); it does not close the window
    // before that (no replica ack here: the next test).
    assert!(
        run.refused > 0,
        "the isolated primary refused nothing: {}",
        run.report
    );
    // Fewer answers lost than the 10 without it, but not none: what the
    // primary acknowledged before it noticed its replica's lag is gone.
    assert!(
        run.redis_lost > 0 && run.redis_lost < 10,
        "Redis lost {} answers: {}",
        run.redis_lost,
        run.report
    );
    assert!(run.report.is_clean(), "{}", run.report);
}

/// The ack's timeout in the split brain: longer than the isolated primary
/// takes to refuse writes (`min-replicas-max-lag` 1 s, counted in whole
/// seconds from the replica's last ACK, sent every second, and checked
/// every second: at most about 3 s), so a 503's retry never finds the
/// isolated primary still replaying what it stored unacknowledged.
const SPLIT_ACK: Duration = Duration::from_millis(3500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_replicas_to_write_with_a_replica_ack_loses_no_acknowledged_answer() {
    let Some(run) = split_brain(
        "splitack",
        SplitSettings {
            min_replicas: true,
            replica_ack: Some(SPLIT_ACK),
            ..UNSAFE
        },
    )
    .await
    else {
        return;
    };
    // Every 2xx a client got is still there after the failover: nothing
    // the isolated primary stored was answered before a replica had it.
    assert_eq!(
        (run.redis_lost, run.acknowledged),
        (0, 0),
        "acknowledged during the partition (lost in Redis): {}",
        run.report
    );
    assert!(run.refused > 0, "{}", run.report);
    // And the fence: no payment twice, every key answered after the heal
    // with its one payment.
    assert!(run.report.is_clean(), "{}", run.report);
    assert!(run.report.unanswered.is_empty(), "{}", run.report);
}

/// The replica ack without `min-replicas-to-write`: the isolated primary
/// never refuses, so the retry of a 503 gets the replay of what it stored
/// unacknowledged, and that answer is lost with it (the fence still pays
/// once). Measured for docs/partitions.md; not in the bounded run (time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: cargo test --release -p idem-example-payments --test partitions -- --ignored a_replica_ack_alone"]
async fn a_replica_ack_alone_still_loses_the_replays_of_the_isolated_primary() {
    let Some(run) = split_brain(
        "splitao",
        SplitSettings {
            replica_ack: Some(SPLIT_ACK),
            ..UNSAFE
        },
    )
    .await
    else {
        return;
    };
    assert!(run.redis_lost > 0, "{}", run.report);
    assert!(run.report.is_clean(), "{}", run.report);
}

/// The weakest settings: no `min-replicas-to-write`, no ack, the fence on.
const UNSAFE: SplitSettings = SplitSettings {
    fence: true,
    min_replicas: false,
    replica_ack: None,
};

// ---------------------------------------------------------------------------
// The randomized nemesis (scripts/partition-soak.sh): ignored by default.

/// For `$DURATION` seconds (default 60) the nemesis draws faults from
/// `$NEMESIS_SEED` (printed; random when unset) among the API's namespace,
/// Redis, Postgres and the writer (both-way and one-way partitions, cuts,
/// the writer killed and restarted) while clients pay a new key every
/// 250 ms, each key by two clients; then everything heals and every key is
/// sent again. With the fence on a single Postgres: no double effect, no
/// lost or contradicting answer, everything mirrored.
#[test]
#[ignore = "long: run by scripts/partition-soak.sh"]
fn a_random_nemesis_never_pays_twice_with_the_fence() {
    let seconds: u64 = match std::env::var("DURATION") {
        Ok(text) => text
            .parse()
            .unwrap_or_else(|e| panic!("DURATION={text:?} is not seconds: {e}")),
        Err(_) => 60,
    };
    let duration = Duration::from_secs(seconds);
    let scenario = "soak";
    let Some(mut net) = lab::net(scenario) else {
        return;
    };
    let (pg_host, redis_host, writer_host) =
        (net.host("pg"), net.host("redis"), net.host("writer"));
    let api_host = net.host("api");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let postgres = lab::postgres(&net, &pg_host);
    let redis = NsRedis::primary(&redis_host, &[]);
    let url = read_write_url(&[&pg_host], postgres.port);
    let redis_url = redis.url();
    let options = ApiOptions {
        redis_url: &redis_url,
        database_url: &url,
        fence: true,
        processor_delay: Duration::from_millis(300),
        lease: Duration::from_secs(2),
    };
    let (api, _forward, base) = runtime.block_on(start_api_in(&api_host, &options));
    let writer_source = ["--redis", redis_url.as_str()];
    let mut writer = start_writer_in(Some(writer_host.netns()), &writer_source, &url);
    let mut nemesis = match Nemesis::from_env(&net) {
        Ok(nemesis) => nemesis,
        Err(e) => panic!("{e}"),
    };
    let sides = [
        (&api_host).into(),
        (&pg_host).into(),
        (&redis_host).into(),
        (&writer_host).into(),
    ];
    let steps = nemesis.random_schedule(duration, &sides, &[Fault::Kill("writer".into())]);
    let keys = (seconds * 4) as usize;
    let clients = Clients::new(scenario, Duration::from_secs(5));
    let bases = [base];
    let patience = duration + Duration::from_secs(30);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            nemesis.run(&steps, &mut |fault| {
                if let Fault::Kill(_) = fault {
                    drop(std::mem::replace(
                        &mut writer,
                        start_writer_in(Some(writer_host.netns()), &writer_source, &url),
                    ));
                }
            })
        });
        runtime.block_on(async {
            let gap = Duration::from_millis(250);
            let originals = clients.spawn_staggered(&bases, 0..keys, gap, patience);
            tokio::time::sleep(Duration::from_millis(500)).await;
            let retries = clients.spawn_staggered(&bases, 0..keys, gap, patience);
            collect(originals).await;
            collect(retries).await;
        });
    });
    assert!(nemesis.is_healed());
    let report = runtime.block_on(async {
        collect(clients.spawn(&bases, 0..keys, Duration::from_secs(30))).await;
        let observed = settle(scenario, 0..keys, &url, &[&redis], WRITER_TIME).await;
        check(&clients.history.requests(), &observed)
    });
    println!("soak (seed {}, {seconds} s): {report}", nemesis.seed());
    assert!(report.is_clean(), "seed {}: {report}", nemesis.seed());
    assert!(
        report.unanswered.is_empty(),
        "seed {}: {report}",
        nemesis.seed()
    );
    drop((api, writer));
}
