//! The history checker: given every operation's invocation and reply (times
//! on one monotonic clock, in ms) and the records read back at the end, it
//! finds lost acknowledged completions, two holders answered `new` within
//! one lease, and tokens going backwards. Conservative: an operation whose
//! reply never came may or may not have happened, and only what is certain
//! from the times counts as a violation.

use std::collections::{BTreeMap, HashMap};

/// Slack for the server's whole-millisecond clock against ours.
const CLOCK_SLACK_MS: f64 = 5.0;

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    Begin { lease_ms: u64, wait: bool },
    Complete { token: u64, body: Vec<u8> },
    Abort { token: u64 },
    Touch { token: u64, lease_ms: u64 },
}

/// What came back. `Unknown`: the connection failed before a reply, so the
/// command may or may not have been applied.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    New(u64),
    InFlight,
    Replay(Vec<u8>),
    Mismatch,
    Ok,
    Int(i64),
    Error(String),
    Unknown,
}

#[derive(Debug, Clone)]
pub struct Event {
    pub client: usize,
    pub key: String,
    pub op: Op,
    pub invoke: f64,
    pub reply_at: f64,
    pub reply: Reply,
}

/// A record read back after the run: token and body when completed.
#[derive(Debug, Clone, PartialEq)]
pub enum Final {
    Missing,
    InProgress { token: u64 },
    Completed { token: u64, body: Vec<u8> },
}

#[derive(Debug, Default)]
pub struct Report {
    pub operations: usize,
    pub unknown: usize,
    pub grants: usize,
    pub acked_completions: usize,
    /// Acknowledged COMPLETEs whose response a later reader or the final
    /// state did not see: (key, token, why).
    pub lost_completions: Vec<(String, u64, String)>,
    /// Two `new` answers on one key where the first holder's lease was
    /// certainly alive and unreleased when the second was granted.
    pub double_new: Vec<(String, u64, u64)>,
    /// A grant that started after another one ended but got a smaller token.
    pub token_regressions: Vec<(String, u64, String, u64)>,
    /// Replays of a body nobody sent to COMPLETE for that key.
    pub foreign_replays: Vec<(String, Vec<u8>)>,
}

impl Report {
    pub fn violations(&self) -> usize {
        self.lost_completions.len()
            + self.double_new.len()
            + self.token_regressions.len()
            + self.foreign_replays.len()
    }
}

struct Grant<'a> {
    ev: &'a Event,
    token: u64,
    lease_ms: u64,
}

pub fn check(events: &[Event], finals: &HashMap<String, Final>) -> Report {
    let mut report = Report {
        operations: events.len(),
        unknown: events.iter().filter(|e| e.reply == Reply::Unknown).count(),
        ..Report::default()
    };
    let mut by_key: BTreeMap<&str, Vec<&Event>> = BTreeMap::new();
    for e in events {
        by_key.entry(&e.key).or_default().push(e);
    }
    let mut grants = Vec::new();
    for (key, evs) in &by_key {
        check_key(key, evs, finals.get(*key), &mut report, &mut grants);
    }
    report.grants = grants.len();
    check_tokens(&mut grants, &mut report);
    report
}

fn check_key<'a>(
    key: &str,
    evs: &[&'a Event],
    fin: Option<&Final>,
    report: &mut Report,
    grants: &mut Vec<Grant<'a>>,
) {
    let mut key_grants: Vec<Grant> = evs
        .iter()
        .filter_map(|e| match (&e.op, &e.reply) {
            (Op::Begin { lease_ms, .. }, Reply::New(t)) => Some(Grant {
                ev: e,
                token: *t,
                lease_ms: *lease_ms,
            }),
            _ => None,
        })
        .collect();
    key_grants.sort_by_key(|g| g.token);

    // Bodies a COMPLETE may have stored (acknowledged or not).
    let sent: Vec<&[u8]> = evs
        .iter()
        .filter(|e| !matches!(e.reply, Reply::Error(_)))
        .filter_map(|e| match &e.op {
            Op::Complete { body, .. } => Some(&body[..]),
            _ => None,
        })
        .collect();
    for e in evs {
        if let Reply::Replay(body) = &e.reply {
            if !sent.contains(&&body[..]) {
                report.foreign_replays.push((key.into(), body.clone()));
            }
        }
    }

    // Every acknowledged completion stays: later BEGINs replay its body,
    // none answers `new`, and the final record is exactly it.
    for c in evs.iter().filter(|e| e.reply == Reply::Ok) {
        let Op::Complete { token, body } = &c.op else {
            continue;
        };
        report.acked_completions += 1;
        let mut lost = |why: String| report.lost_completions.push((key.into(), *token, why));
        let later = evs.iter().filter(|e| e.invoke > c.reply_at);
        if let Some(e) = later.clone().find(|e| matches!(e.reply, Reply::New(_))) {
            lost(format!(
                "client {} got {:?} at {:.0} ms",
                e.client, e.reply, e.invoke
            ));
            continue;
        }
        if let Some(e) = later.clone().find(|e| match &e.reply {
            Reply::Replay(b) => b != body,
            _ => false,
        }) {
            lost(format!(
                "client {} replayed another body at {:.0} ms",
                e.client, e.invoke
            ));
            continue;
        }
        match fin {
            Some(Final::Completed { token: t, body: b }) if t == token && b == body => {}
            other => lost(format!("final record {other:?}")),
        }
    }

    // Two holders within one lease.
    for pair in key_grants.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let alive_until = lease_alive_until(a, evs, b.ev);
        let released = evs.iter().any(|e| {
            e.client == a.ev.client
                && e.invoke <= b.ev.reply_at
                && matches!(e.op, Op::Abort { token } if token == a.token)
                && matches!(e.reply, Reply::Int(1) | Reply::Unknown)
        });
        if !released && b.ev.reply_at + CLOCK_SLACK_MS < alive_until {
            report.double_new.push((key.into(), a.token, b.token));
        }
    }
    grants.extend(key_grants);
}

/// The time until which the holder's lease was certainly alive when the
/// grant `b` was decided. The lease ends where the BEGIN or the last applied
/// TOUCH set it (a TOUCH sets `now + lease-ms`, which may shorten it), each
/// counted from no earlier than its invocation. The last TOUCH certainly
/// applied before `b` (acknowledged before `b` was sent) and every later one
/// that may have been applied are candidates; the bound is the least.
fn lease_alive_until(g: &Grant, evs: &[&Event], b: &Event) -> f64 {
    let touches: Vec<(&Event, u64)> = evs
        .iter()
        .filter(|e| e.invoke <= b.reply_at)
        .filter(|e| matches!(e.reply, Reply::Int(n) if n > 0) || e.reply == Reply::Unknown)
        .filter_map(|e| match e.op {
            Op::Touch { token, lease_ms } if token == g.token => Some((*e, lease_ms)),
            _ => None,
        })
        .collect();
    let certain = touches
        .iter()
        .filter(|(e, _)| e.reply != Reply::Unknown && e.reply_at < b.invoke)
        .map(|(e, _)| e.invoke)
        .fold(f64::NEG_INFINITY, f64::max);
    let from_begin = if certain.is_finite() {
        f64::INFINITY
    } else {
        g.ev.invoke + g.lease_ms as f64
    };
    touches
        .iter()
        .filter(|(e, _)| e.invoke >= certain)
        .map(|(e, ms)| e.invoke + *ms as f64)
        .fold(from_begin, f64::min)
}

/// Tokens only grow on a node: a grant invoked after another's reply has a
/// larger token (for its key and node-wide).
fn check_tokens(grants: &mut [Grant], report: &mut Report) {
    grants.sort_by(|a, b| a.ev.reply_at.total_cmp(&b.ev.reply_at));
    // Prefix maximum of tokens in reply order.
    let mut best: Vec<(f64, u64, usize)> = Vec::with_capacity(grants.len());
    for (i, g) in grants.iter().enumerate() {
        let prev = best.last().copied();
        best.push(match prev {
            Some((_, t, j)) if t >= g.token => (g.ev.reply_at, t, j),
            _ => (g.ev.reply_at, g.token, i),
        });
    }
    for g in grants.iter() {
        // The grants that certainly replied before this one was invoked.
        let n = best.partition_point(|&(at, _, _)| at < g.ev.invoke);
        if n == 0 {
            continue;
        }
        let (_, max, j) = best[n - 1];
        if max >= g.token {
            let earlier = &grants[j];
            report.token_regressions.push((
                g.ev.key.clone(),
                g.token,
                earlier.ev.key.clone(),
                earlier.token,
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(client: usize, key: &str, op: Op, at: (f64, f64), reply: Reply) -> Event {
        Event {
            client,
            key: key.into(),
            op,
            invoke: at.0,
            reply_at: at.1,
            reply,
        }
    }

    fn begin(lease_ms: u64) -> Op {
        Op::Begin {
            lease_ms,
            wait: false,
        }
    }

    fn complete(token: u64, body: &str) -> Op {
        Op::Complete {
            token,
            body: body.into(),
        }
    }

    fn done(token: u64, body: &str) -> HashMap<String, Final> {
        HashMap::from([(
            "k".to_string(),
            Final::Completed {
                token,
                body: body.into(),
            },
        )])
    }

    #[test]
    fn a_clean_history_passes() {
        let h = [
            ev(0, "k", begin(100), (0.0, 1.0), Reply::New(10)),
            ev(1, "k", begin(100), (2.0, 3.0), Reply::InFlight),
            ev(0, "k", complete(10, "b"), (4.0, 5.0), Reply::Ok),
            ev(1, "k", begin(100), (6.0, 7.0), Reply::Replay("b".into())),
        ];
        let r = check(&h, &done(10, "b"));
        assert_eq!((r.violations(), r.acked_completions, r.grants), (0, 1, 1));
    }

    #[test]
    fn a_lost_completion_is_found_by_a_later_new_or_the_final_state() {
        let h = [
            ev(0, "k", begin(100), (0.0, 1.0), Reply::New(10)),
            ev(0, "k", complete(10, "b"), (4.0, 5.0), Reply::Ok),
            ev(1, "k", begin(100), (200.0, 201.0), Reply::New(20)),
        ];
        let r = check(&h, &done(20, "c"));
        assert_eq!(r.lost_completions.len(), 1, "{r:?}");
        let r = check(&h[..2], &HashMap::new());
        assert_eq!(r.lost_completions.len(), 1, "{r:?}");
    }

    #[test]
    fn two_holders_in_one_lease_are_found_unless_released_or_lapsed() {
        let a = ev(0, "k", begin(100), (0.0, 1.0), Reply::New(10));
        let b = ev(1, "k", begin(100), (50.0, 51.0), Reply::New(20));
        let r = check(&[a.clone(), b.clone()], &HashMap::new());
        assert_eq!(r.double_new, vec![("k".into(), 10, 20)]);
        // Released by an ABORT (even one whose reply was lost).
        let abort = ev(
            0,
            "k",
            Op::Abort { token: 10 },
            (20.0, 21.0),
            Reply::Unknown,
        );
        let r = check(&[a.clone(), abort, b.clone()], &HashMap::new());
        assert!(r.double_new.is_empty());
        // The lease lapsed before the second grant.
        let late = ev(1, "k", begin(100), (150.0, 151.0), Reply::New(20));
        assert!(check(&[a.clone(), late], &HashMap::new())
            .double_new
            .is_empty());
        // A TOUCH kept it alive.
        let touch = ev(
            0,
            "k",
            Op::Touch {
                token: 10,
                lease_ms: 300,
            },
            (90.0, 91.0),
            Reply::Int(300),
        );
        let late = ev(1, "k", begin(100), (150.0, 151.0), Reply::New(20));
        assert_eq!(
            check(&[a, touch, late], &HashMap::new()).double_new.len(),
            1
        );
    }

    #[test]
    fn tokens_going_backwards_are_found() {
        let h = [
            ev(0, "k", begin(100), (0.0, 1.0), Reply::New(10)),
            ev(1, "j", begin(100), (2.0, 3.0), Reply::New(9)),
            // Overlapping in time: either order is fine.
            ev(2, "i", begin(100), (0.5, 4.0), Reply::New(8)),
        ];
        let r = check(&h, &HashMap::new());
        assert_eq!(r.token_regressions, vec![("j".into(), 9, "k".into(), 10)]);
    }

    #[test]
    fn a_replay_of_a_body_nobody_sent_is_found() {
        let h = [ev(
            0,
            "k",
            begin(100),
            (0.0, 1.0),
            Reply::Replay("x".into()),
        )];
        assert_eq!(check(&h, &HashMap::new()).foreign_replays.len(), 1);
    }
}
