//! A checked history for partition tests: clients record every request they
//! send (key, attempt, when sent and answered) and its answer; `check` holds
//! the history against what the stores kept afterwards and reports each
//! anomaly a payment API must not show: an effect run twice (payment rows,
//! processor charges), an acknowledged payment that is gone, two payment
//! ids answered 2xx for one key, a completion Redis holds that Postgres
//! never got after the writer had time; and (`unkept_answers`) answers a
//! failover took from Redis.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How one request ended, as its client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A 2xx carrying the payment's id: the payment is acknowledged.
    Paid { status: u16, payment: i64 },
    /// Any other HTTP status (409 in flight, 503, 5xx, ...).
    Status(u16),
    /// No HTTP answer: connection refused or reset, timeout.
    Failed(String),
}

/// One request of one client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub key: String,
    /// 1 for the client's first request with this key, then 2, 3, ...
    pub attempt: u32,
    /// Since the history began.
    pub sent: Duration,
    pub answered: Duration,
    pub answer: Answer,
}

/// The requests of a run, appended by concurrent clients.
pub struct History {
    start: Instant,
    requests: Mutex<Vec<Request>>,
}

impl Default for History {
    fn default() -> Self {
        History::new()
    }
}

impl History {
    pub fn new() -> Self {
        History {
            start: Instant::now(),
            requests: Mutex::new(Vec::new()),
        }
    }

    /// Time since the history began (a request's `sent`).
    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    /// Appends a request sent at `sent` (from `now`) and answered now.
    pub fn record(&self, key: &str, attempt: u32, sent: Duration, answer: Answer) {
        let request = Request {
            key: key.to_string(),
            attempt,
            sent,
            answered: self.now(),
            answer,
        };
        self.lock().push(request);
    }

    /// The requests so far, in the order they were answered.
    pub fn requests(&self) -> Vec<Request> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Request>> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the stores held once the run was over (and healed, and the writer
/// had time), by the clients' keys.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// Each key's payment ids in Postgres.
    pub payments: BTreeMap<String, Vec<i64>>,
    /// Each key's number of charges at the processor.
    pub charges: BTreeMap<String, u32>,
    /// Keys Redis holds as completed.
    pub redis_completed: BTreeSet<String>,
    /// Keys the Postgres mirror (`idempotency_keys`) holds as completed.
    pub mirrored: BTreeSet<String>,
}

/// The anomalies `check` found; `is_clean` when there are none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Keys with more than one payment row.
    pub doubled: Vec<String>,
    /// Keys charged more than once at the processor.
    pub double_charged: Vec<String>,
    /// Acknowledged payments (a 2xx a client saw) Postgres no longer has.
    pub lost: Vec<(String, i64)>,
    /// Keys whose 2xx answers carry different payment ids.
    pub contradicting: Vec<(String, BTreeSet<i64>)>,
    /// Keys Redis holds as completed that the mirror does not.
    pub unmirrored: Vec<String>,
    /// Keys no client got a 2xx for (not an anomaly: unavailability).
    pub unanswered: Vec<String>,
    /// Requests in the history, and how many were answered 2xx.
    pub requests: usize,
    pub acknowledged: usize,
}

impl Report {
    /// No double effect, no lost acknowledgement, no contradiction, nothing
    /// left unmirrored (unanswered keys are unavailability, allowed).
    pub fn is_clean(&self) -> bool {
        self.doubled.is_empty()
            && self.double_charged.is_empty()
            && self.lost.is_empty()
            && self.contradicting.is_empty()
            && self.unmirrored.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} requests, {} acknowledged; doubled {}, double-charged {}, lost acknowledged {}, \
             contradicting {}, unmirrored {}, unanswered keys {}",
            self.requests,
            self.acknowledged,
            self.doubled.len(),
            self.double_charged.len(),
            self.lost.len(),
            self.contradicting.len(),
            self.unmirrored.len(),
            self.unanswered.len()
        )?;
        for (name, keys) in [
            ("doubled", &self.doubled),
            ("double-charged", &self.double_charged),
            ("unmirrored", &self.unmirrored),
        ] {
            if !keys.is_empty() {
                write!(f, "\n  {name}: {keys:?}")?;
            }
        }
        if !self.lost.is_empty() {
            write!(f, "\n  lost: {:?}", self.lost)?;
        }
        if !self.contradicting.is_empty() {
            write!(f, "\n  contradicting: {:?}", self.contradicting)?;
        }
        Ok(())
    }
}

/// Holds `requests` against `observed`.
pub fn check(requests: &[Request], observed: &Observed) -> Report {
    let mut report = Report {
        requests: requests.len(),
        ..Report::default()
    };
    let mut answered: BTreeMap<&str, BTreeSet<i64>> = BTreeMap::new();
    let mut keys: BTreeSet<&str> = BTreeSet::new();
    for request in requests {
        keys.insert(&request.key);
        if let Answer::Paid { payment, .. } = request.answer {
            report.acknowledged += 1;
            answered.entry(&request.key).or_default().insert(payment);
        }
    }
    let kept: BTreeSet<i64> = observed.payments.values().flatten().copied().collect();
    for (key, ids) in &answered {
        for id in ids.iter().filter(|id| !kept.contains(id)) {
            report.lost.push((key.to_string(), *id));
        }
        if ids.len() > 1 {
            report.contradicting.push((key.to_string(), ids.clone()));
        }
    }
    report.doubled = observed
        .payments
        .iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|(key, _)| key.clone())
        .collect();
    report.double_charged = observed
        .charges
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(key, _)| key.clone())
        .collect();
    report.unmirrored = observed
        .redis_completed
        .difference(&observed.mirrored)
        .cloned()
        .collect();
    report.unanswered = keys
        .into_iter()
        .filter(|key| !answered.contains_key(key))
        .map(str::to_string)
        .collect();
    report
}

/// The keys answered 2xx in `requests` that `kept` (the keys a server
/// holds as completed, e.g. the promoted replica after a failover) lacks:
/// acknowledged answers Redis lost, whatever Postgres kept.
pub fn unkept_answers(requests: &[Request], kept: &BTreeSet<String>) -> BTreeSet<String> {
    requests
        .iter()
        .filter(|r| matches!(r.answer, Answer::Paid { .. }))
        .filter(|r| !kept.contains(&r.key))
        .map(|r| r.key.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(key: &str, attempt: u32, answer: Answer) -> Request {
        let sent = Duration::from_millis(u64::from(attempt) * 100);
        Request {
            key: key.to_string(),
            attempt,
            sent,
            answered: sent + Duration::from_millis(50),
            answer,
        }
    }

    fn paid(payment: i64) -> Answer {
        Answer::Paid {
            status: 201,
            payment,
        }
    }

    /// Two keys paid once each, charged once, completed and mirrored.
    fn clean() -> (Vec<Request>, Observed) {
        let requests = vec![
            request("a", 1, Answer::Failed("connection reset".into())),
            request("a", 2, Answer::Status(409)),
            request("a", 3, paid(1)),
            request("b", 1, paid(2)),
            request(
                "b",
                2,
                Answer::Paid {
                    status: 200,
                    payment: 2,
                },
            ),
        ];
        let observed = Observed {
            payments: [("a".into(), vec![1]), ("b".into(), vec![2])].into(),
            charges: [("a".into(), 1), ("b".into(), 1)].into(),
            redis_completed: ["a".into(), "b".into()].into(),
            mirrored: ["a".into(), "b".into()].into(),
        };
        (requests, observed)
    }

    #[test]
    fn a_clean_history_reports_nothing() {
        let (requests, observed) = clean();
        let report = check(&requests, &observed);
        assert!(report.is_clean(), "{report}");
        assert_eq!((report.requests, report.acknowledged), (5, 3));
        assert!(report.unanswered.is_empty());
    }

    #[test]
    fn a_second_payment_row_is_a_double_effect() {
        let (requests, mut observed) = clean();
        observed.payments.insert("a".into(), vec![1, 7]);
        let report = check(&requests, &observed);
        assert_eq!(report.doubled, ["a"]);
        assert!(!report.is_clean());
    }

    #[test]
    fn a_second_charge_is_a_double_effect() {
        let (requests, mut observed) = clean();
        observed.charges.insert("b".into(), 2);
        let report = check(&requests, &observed);
        assert_eq!(report.double_charged, ["b"]);
        assert!(!report.is_clean());
    }

    #[test]
    fn an_acknowledged_payment_missing_from_postgres_is_lost() {
        let (requests, mut observed) = clean();
        observed.payments.remove("b");
        let report = check(&requests, &observed);
        assert_eq!(report.lost, [("b".to_string(), 2)]);
        assert!(!report.is_clean());
        // A payment no client was answered for may go: nobody was told.
        let (mut requests, mut observed) = clean();
        requests.retain(|r| r.key != "b");
        observed.payments.remove("b");
        assert!(check(&requests, &observed).is_clean());
    }

    #[test]
    fn two_ids_answered_for_one_key_contradict() {
        let (mut requests, mut observed) = clean();
        requests.push(request("a", 4, paid(9)));
        observed.payments.insert("x".into(), vec![9]);
        let report = check(&requests, &observed);
        assert_eq!(report.contradicting, [("a".to_string(), [1, 9].into())]);
        assert!(report.lost.is_empty() && report.doubled.is_empty());
        assert!(!report.is_clean());
    }

    #[test]
    fn a_completion_redis_holds_but_postgres_lacks_is_unmirrored() {
        let (requests, mut observed) = clean();
        observed.mirrored.remove("a");
        let report = check(&requests, &observed);
        assert_eq!(report.unmirrored, ["a"]);
        assert!(!report.is_clean());
        // Mirrored but gone from Redis (expired, flushed) is fine.
        let (requests, mut observed) = clean();
        observed.redis_completed.remove("a");
        assert!(check(&requests, &observed).is_clean());
    }

    #[test]
    fn an_answer_the_failover_dropped_is_unkept_and_a_refusal_is_not() {
        let (mut requests, _) = clean();
        requests.push(request("c", 1, Answer::Status(503)));
        let kept: BTreeSet<String> = ["a".to_string()].into();
        // b was answered 2xx twice and is gone: one key; c was never
        // answered 2xx: nobody was told.
        assert_eq!(unkept_answers(&requests, &kept), ["b".to_string()].into());
        let all: BTreeSet<String> = ["a".into(), "b".into()].into();
        assert!(unkept_answers(&requests, &all).is_empty());
    }

    #[test]
    fn a_key_never_answered_2xx_is_unavailability_not_an_anomaly() {
        let (mut requests, observed) = clean();
        requests.push(request("c", 1, Answer::Status(503)));
        requests.push(request("c", 2, Answer::Failed("timeout".into())));
        let report = check(&requests, &observed);
        assert_eq!(report.unanswered, ["c"]);
        assert!(report.is_clean());
    }

    #[test]
    fn the_history_keeps_what_concurrent_clients_record() {
        let history = std::sync::Arc::new(History::new());
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let history = history.clone();
                std::thread::spawn(move || {
                    for attempt in 1..=25 {
                        let sent = history.now();
                        history.record(&format!("k{i}"), attempt, sent, Answer::Status(409));
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let requests = history.requests();
        assert_eq!(requests.len(), 100);
        assert!(requests.iter().all(|r| r.answered >= r.sent));
        let report = check(&requests, &Observed::default());
        assert_eq!(report.unanswered, ["k0", "k1", "k2", "k3"]);
    }
}
