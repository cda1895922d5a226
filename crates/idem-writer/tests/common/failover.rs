//! Shared by the failover tests: a load of BEGIN/COMPLETE (+ `WAIT 1`) that
//! keeps going through a failover, holding Postgres' table locked so that
//! records are pending when the primary changes, and the check of what
//! Redis and Postgres hold afterwards.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use idem_testkit::eventually;

use super::{
    assert_no_regressions, connect_pg, install_regression_trap, metric, mirror_state,
    redis_records, row_count, rows, try_complete_keys, wait_until, Completion, WriterProcess,
};

/// Finds the current primary of a shard: `(port, connection)`, or `None`
/// while there is none reachable.
pub type Route = Box<dyn FnMut(usize) -> Option<(u16, redis::Connection)> + Send>;

/// A completion and the port of the primary that acknowledged it.
#[derive(Debug, Clone)]
pub struct Done {
    pub completion: Completion,
    pub port: u16,
    /// `WAIT 1` confirmed that a replica had it.
    pub replicated: bool,
}

/// A thread completing keys `{tag}:load-N` round-robin over the shards'
/// tags, 10 per shard per round, until stopped; routing errors only skip a
/// round.
pub struct Load {
    stop: Arc<AtomicBool>,
    pub done: Arc<Mutex<Vec<Done>>>,
    handle: Option<JoinHandle<Route>>,
}

impl Load {
    pub fn start(tags: Vec<String>, mut route: Route) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(Mutex::new(Vec::new()));
        let (stop_flag, sink) = (stop.clone(), done.clone());
        let handle = std::thread::spawn(move || {
            let mut conns: Vec<Option<(u16, redis::Connection)>> =
                tags.iter().map(|_| None).collect();
            let mut n = 0usize;
            while !stop_flag.load(Ordering::Relaxed) {
                for (shard, tag) in tags.iter().enumerate() {
                    if conns[shard].is_none() {
                        conns[shard] = route(shard);
                    }
                    let Some((port, conn)) = conns[shard].as_mut() else {
                        continue;
                    };
                    let keys: Vec<String> = (n..n + 10)
                        .map(|i| format!("{{{tag}}}:load-{i:07}"))
                        .collect();
                    n += 10;
                    match try_complete_keys(conn, &keys, 3600, Some((1, 200))) {
                        Ok((completions, replicas)) => {
                            let port = *port;
                            sink.lock().unwrap().extend(completions.into_iter().map(
                                |completion| Done {
                                    completion,
                                    port,
                                    replicated: replicas >= 1,
                                },
                            ));
                        }
                        Err(_) => conns[shard] = None,
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            route
        });
        Load {
            stop,
            done,
            handle: Some(handle),
        }
    }

    /// Completions acknowledged by the primary on `port` so far.
    pub fn count_on(&self, port: u16) -> usize {
        self.done
            .lock()
            .unwrap()
            .iter()
            .filter(|d| d.port == port)
            .count()
    }

    /// Stops the thread; every completion made, and the route back.
    pub fn stop(mut self) -> (Vec<Done>, Route) {
        self.stop.store(true, Ordering::Relaxed);
        let route = self.handle.take().unwrap().join().expect("load thread");
        let done = std::mem::take(&mut *self.done.lock().unwrap());
        (done, route)
    }
}

/// What Redis and Postgres hold for the load's completions afterwards.
#[derive(Debug, Default)]
pub struct Outcome {
    pub completed: usize,
    pub replicated: usize,
    /// In Redis afterwards, completed with the same token and response.
    pub survived: usize,
    /// Replicated (`WAIT 1` said so) but gone from Redis: must be 0.
    pub lost_replicated: usize,
    /// Gone from Redis without a replica having confirmed it.
    pub lost_unreplicated: usize,
    /// Survivors whose row is missing or holds an older token.
    pub unmirrored: usize,
    /// Survivors not acknowledged (IDEM.GET `mirror` not `mirrored`).
    pub unacknowledged: usize,
    /// Survivors completed on each port, and of those, the unmirrored ones.
    pub unmirrored_by_port: HashMap<u16, usize>,
}

/// Reads every completion back from the shard's current primary and from
/// Postgres. A row, when there is one, must match its completion exactly
/// (one row per key, same token, fingerprint, status, body, headers).
pub async fn check(
    done: &[Done],
    tags: &[String],
    route: &mut Route,
    pg: &tokio_postgres::Client,
) -> Outcome {
    let rows = rows(pg).await;
    let mut outcome = Outcome {
        completed: done.len(),
        replicated: done.iter().filter(|d| d.replicated).count(),
        ..Outcome::default()
    };
    for (shard, tag) in tags.iter().enumerate() {
        let prefix = format!("{{{tag}}}:");
        let mine: Vec<&Done> = done
            .iter()
            .filter(|d| d.completion.key.starts_with(&prefix))
            .collect();
        let keys: Vec<String> = mine.iter().map(|d| d.completion.key.clone()).collect();
        let (_, mut conn) = route(shard).unwrap_or_else(|| panic!("no primary for shard {tag}"));
        let in_redis = redis_records(&mut conn, &keys);
        for d in mine {
            let want = &d.completion;
            let survived = in_redis.get(&want.key).is_some_and(|r| {
                r.token as i64 == want.token
                    && r.completed()
                        .is_some_and(|c| i32::from(c.status) == want.status && c.body == want.body)
            });
            if let Some(row) = rows.get(&want.key) {
                assert_eq!(row.token, want.token, "{} token", want.key);
                assert_eq!(
                    row.fingerprint, want.fingerprint_hex,
                    "{} fingerprint",
                    want.key
                );
                assert_eq!(
                    row.response_status,
                    Some(want.status),
                    "{} status",
                    want.key
                );
                assert_eq!(
                    row.response_body.as_deref(),
                    Some(want.body.as_slice()),
                    "{} body",
                    want.key
                );
                assert_eq!(row.response_headers, want.headers, "{} headers", want.key);
            }
            if !survived {
                if d.replicated {
                    outcome.lost_replicated += 1;
                } else {
                    outcome.lost_unreplicated += 1;
                }
                continue;
            }
            outcome.survived += 1;
            if !rows.contains_key(&want.key) {
                outcome.unmirrored += 1;
                *outcome.unmirrored_by_port.entry(d.port).or_default() += 1;
            }
            if mirror_state(&in_redis[&want.key]) != "mirrored" {
                outcome.unacknowledged += 1;
            }
        }
    }
    outcome
}

/// Holds `idempotency_keys` locked against writes (the writer's upserts
/// wait) until released.
pub struct TableLock(tokio_postgres::Client);

impl TableLock {
    pub async fn take(url: &str) -> Self {
        let client = super::connect_pg(url).await;
        client
            .batch_execute("BEGIN; LOCK TABLE idempotency_keys IN EXCLUSIVE MODE")
            .await
            .expect("lock idempotency_keys");
        TableLock(client)
    }

    pub async fn release(self) {
        self.0.batch_execute("COMMIT").await.expect("unlock");
    }
}

/// The series `name{node="127.0.0.1:port/0"}` of the writer's metrics.
pub fn node_series(name: &str, port: u16) -> String {
    format!("{name}{{node=\"127.0.0.1:{port}/0\"}}")
}

/// A failover run's result.
pub struct Run {
    pub outcome: Outcome,
    /// The replica promoted, and the primary it replaced.
    pub promoted_port: u16,
    pub victim_port: u16,
    /// The writer's `/metrics` at the end.
    pub metrics: String,
    pub writer: WriterProcess,
}

/// What a run with topology following shows: no replicated record lost,
/// every surviving record mirrored once and acknowledged, by the same writer
/// process, which now mirrors the promoted node and no longer the old one.
pub fn assert_followed(run: &mut Run) {
    let o = &run.outcome;
    eprintln!("followed: {o:?}");
    assert!(o.replicated >= 200, "{o:?}");
    assert_eq!(o.lost_replicated, 0, "{o:?}");
    assert_eq!(o.unmirrored, 0, "{o:?}");
    assert_eq!(o.unacknowledged, 0, "{o:?}");
    assert!(
        run.writer.is_running(),
        "the writer stopped:\n{}",
        run.writer.log_tail()
    );
    let gauge = |port| {
        metric(
            &run.metrics,
            &node_series("idem_writer_node_mirrored", port),
        )
    };
    assert_eq!(gauge(run.promoted_port), Some(1.0), "{}", run.metrics);
    assert_eq!(gauge(run.victim_port), Some(0.0), "{}", run.metrics);
    let changes = metric(&run.metrics, "idem_writer_topology_changes_total");
    assert!(changes >= Some(2.0), "{}", run.metrics);
}

/// What the same run without following shows (teeth): the records completed
/// on the promoted primary, and those it had pending from the old one, stay
/// unmirrored; everything else is mirrored.
pub fn assert_stranded(run: &Run) {
    let o = &run.outcome;
    eprintln!("not followed: {o:?}");
    assert_eq!(o.lost_replicated, 0, "{o:?}");
    let on = |port| o.unmirrored_by_port.get(&port).copied().unwrap_or(0);
    assert!(on(run.promoted_port) >= 200, "{o:?}");
    assert_eq!(
        o.unmirrored,
        on(run.promoted_port) + on(run.victim_port),
        "{o:?}"
    );
}

/// A primary with a replica about to take over, as [`drive`] needs it.
pub trait FailoverSetup {
    /// Records pending on the replica that will be promoted.
    fn replica_pending(&mut self) -> i64;
    /// Fails over; returns once the replica is a primary.
    fn fail_over(&mut self);
    /// Records pending on all primaries now (after the failover).
    fn pending_on_primaries(&mut self) -> i64;
}

/// Load on every shard (`tags`) until the writer has mirrored some;
/// Postgres locked so that records pile up pending, also on the replica;
/// the failover; load until the promoted primary has acknowledged 200
/// completions; Postgres unlocked; then (`follow`) wait until nothing is
/// pending anywhere, or (not following) give the writer 5 s; and check.
/// `ports`: the old primary's and the promoted replica's.
pub async fn drive(
    setup: &mut dyn FailoverSetup,
    writer: WriterProcess,
    database_url: &str,
    tags: Vec<String>,
    route: Route,
    follow: bool,
    (victim_port, promoted_port): (u16, u16),
) -> Run {
    let pg = connect_pg(database_url).await;
    install_regression_trap(&pg).await;
    let load = Load::start(tags.clone(), route);
    let mirroring = wait_until(Duration::from_secs(30), || async {
        row_count(&pg).await >= 300
    })
    .await;
    assert!(mirroring, "nothing mirrored:\n{}", writer.log_tail());

    let lock = TableLock::take(database_url).await;
    let piled_up = eventually(Duration::from_secs(30), || setup.replica_pending() >= 200);
    assert!(piled_up, "records did not pile up on the replica");
    setup.fail_over();
    let served = eventually(Duration::from_secs(30), || {
        load.count_on(promoted_port) >= 200
    });
    assert!(served, "no load reached the promoted primary");
    lock.release().await;
    let (done, mut route) = load.stop();

    if follow {
        let drained = eventually(Duration::from_secs(30), || {
            setup.pending_on_primaries() == 0
        });
        assert!(drained, "pending records left:\n{}", writer.log_tail());
    } else {
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    let outcome = check(&done, &tags, &mut route, &pg).await;
    assert_no_regressions(&pg).await;
    let (_, metrics) = writer.http_get("/metrics");
    Run {
        outcome,
        promoted_port,
        victim_port,
        metrics,
        writer,
    }
}
