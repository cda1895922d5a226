//! The decision table of the four outcomes, and the holder's transitions.
//!
//! Each function takes the record under the key (if any) and the primary's
//! clock, and either answers or changes the record in place. The module
//! replicates the resulting record, never the decision.

use std::ops::DerefMut;

use crate::args;
use crate::token::TokenClock;
use crate::{Completed, Error, MirrorState, Record, State};

/// What `IDEM.BEGIN` answers.
#[derive(Debug, PartialEq, Eq)]
pub enum Begin<'r> {
    /// No record: store this new in-progress record.
    Created(Record),
    /// The lease had lapsed: the record in place now belongs to `token`.
    TakenOver {
        token: u64,
    },
    InFlight {
        retry_after_ms: u64,
    },
    Replay(&'r Completed),
    Mismatch,
}

/// Decides `IDEM.BEGIN`. The clock is read only when the answer depends on
/// it (a replay or a mismatch never reads it), and the token clock only when
/// a token is issued.
pub fn begin<'r, C: DerefMut<Target = TokenClock>>(
    existing: Option<&'r mut Record>,
    req: &args::Begin,
    now: impl FnOnce() -> u64,
    tokens: impl FnOnce() -> C,
) -> Begin<'r> {
    let Some(rec) = existing else {
        let now = now();
        return Begin::Created(Record {
            fingerprint: req.fingerprint,
            token: tokens().next(now),
            created_at: now,
            expires_at: now.saturating_add(req.ttl_ms),
            state: State::InProgress {
                lease_until: now.saturating_add(req.lease_ms),
            },
        });
    };
    if rec.fingerprint != req.fingerprint {
        return Begin::Mismatch;
    }
    let lease_until = match &mut rec.state {
        State::Completed(c) => return Begin::Replay(c),
        State::InProgress { lease_until } => lease_until,
    };
    let now = now();
    if *lease_until > now {
        return Begin::InFlight {
            retry_after_ms: *lease_until - now,
        };
    }
    *lease_until = now.saturating_add(req.lease_ms);
    let mut tokens = tokens();
    tokens.observe(rec.token, now);
    rec.token = tokens.next(now);
    Begin::TakenOver { token: rec.token }
}

/// Checks that `token` holds the in-progress record.
fn holder(rec: Option<&mut Record>, token: u64) -> Result<&mut Record, Error> {
    let rec = rec.ok_or(Error::NotFound)?;
    if rec.token != token {
        Err(Error::Stale)
    } else if rec.completed().is_some() {
        Err(Error::Completed)
    } else {
        Ok(rec)
    }
}

/// `IDEM.COMPLETE`: the holder stores its response. The token decides, not
/// the clock: a lapsed lease that nobody took over still completes.
pub fn complete(rec: Option<&mut Record>, req: args::Complete, now: u64) -> Result<(), Error> {
    let rec = holder(rec, req.token)?;
    rec.state = State::Completed(Completed {
        status: req.status,
        body: req.body.to_vec(),
        headers: req.headers,
        completed_at: now,
        mirror: if req.mirrored {
            MirrorState::Mirrored
        } else {
            MirrorState::Pending
        },
    });
    Ok(())
}

/// `IDEM.ABORT`: true when the caller holds the in-progress record, which the
/// module then deletes.
pub fn may_abort(rec: Option<&Record>, token: u64) -> bool {
    matches!(rec, Some(r) if r.token == token && matches!(r.state, State::InProgress { .. }))
}

/// `IDEM.TOUCH`: the holder extends its lease to `now + lease_ms`; answers the
/// remaining lease in ms.
pub fn touch(rec: Option<&mut Record>, token: u64, lease_ms: u64, now: u64) -> Result<u64, Error> {
    let rec = holder(rec, token)?;
    rec.state = State::InProgress {
        lease_until: now.saturating_add(lease_ms),
    };
    Ok(lease_ms)
}

/// `IDEM.MIRROR.ACK`: marks the completed record with `token` mirrored.
/// Returns whether it matched, and whether the record changed.
pub fn ack(rec: Option<&mut Record>, token: u64) -> (bool, bool) {
    match rec {
        Some(r) if r.token == token => match &mut r.state {
            State::Completed(c) if c.mirror == MirrorState::Pending => {
                c.mirror = MirrorState::Mirrored;
                (true, true)
            }
            State::Completed(_) => (true, false),
            State::InProgress { .. } => (false, false),
        },
        _ => (false, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(fp: &[u8], lease_ms: u64) -> args::Begin<'static> {
        args::Begin {
            key: b"k",
            fingerprint: crate::Fingerprint::of(fp),
            ttl_ms: 60_000,
            lease_ms,
            wait_ms: None,
            replay: crate::wire::ReplayLayout::Fields,
        }
    }

    fn done(token: u64) -> args::Complete<'static> {
        args::Complete {
            key: b"k",
            token,
            status: 201,
            body: b"{}",
            headers: vec![],
            mirrored: false,
        }
    }

    fn created(tokens: &mut TokenClock, now: u64) -> Record {
        match begin(None, &req(b"a", 1000), || now, || tokens) {
            Begin::Created(r) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_four_outcomes() {
        let mut t = TokenClock::default();
        let mut r = created(&mut t, 10);
        assert_eq!(r.expires_at, 60_010);
        assert_eq!(r.state, State::InProgress { lease_until: 1010 });
        assert_eq!(
            begin(Some(&mut r), &req(b"a", 1000), || 400, || &mut t),
            Begin::InFlight {
                retry_after_ms: 610
            }
        );
        assert_eq!(
            begin(Some(&mut r), &req(b"b", 1000), || 400, || &mut t),
            Begin::Mismatch
        );
        let token = r.token;
        complete(Some(&mut r), done(token), 500).unwrap();
        match begin(Some(&mut r), &req(b"a", 1000), || 600, || &mut t) {
            Begin::Replay(c) => assert_eq!((c.status, c.completed_at), (201, 500)),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            begin(Some(&mut r), &req(b"b", 1000), || 600, || &mut t),
            Begin::Mismatch
        );
    }

    #[test]
    fn takeover_fences_the_old_holder() {
        let mut t = TokenClock::default();
        let mut r = created(&mut t, 10);
        let old = r.token;
        let Begin::TakenOver { token } = begin(Some(&mut r), &req(b"a", 50), || 1010, || &mut t)
        else {
            panic!()
        };
        assert!(token > old);
        assert_eq!(r.expires_at, 60_010, "a takeover keeps the original expiry");
        assert_eq!(complete(Some(&mut r), done(old), 1011), Err(Error::Stale));
        assert_eq!(touch(Some(&mut r), old, 5, 1011), Err(Error::Stale));
        assert!(!may_abort(Some(&r), old));
        assert!(may_abort(Some(&r), token));
        complete(Some(&mut r), done(token), 5000).unwrap(); // lapsed lease, still holder
        assert_eq!(
            complete(Some(&mut r), done(token), 5001),
            Err(Error::Completed)
        );
        assert_eq!(complete(None, done(token), 5001), Err(Error::NotFound));
    }

    #[test]
    fn ack_marks_mirrored_once() {
        let mut t = TokenClock::default();
        let mut r = created(&mut t, 1);
        let tok = r.token;
        assert_eq!(ack(Some(&mut r), tok), (false, false));
        complete(Some(&mut r), done(tok), 2).unwrap();
        assert!(r.mirror_pending());
        assert_eq!(ack(Some(&mut r), tok + 1), (false, false));
        assert_eq!(ack(Some(&mut r), tok), (true, true));
        assert_eq!(ack(Some(&mut r), tok), (true, false));
        assert!(!r.mirror_pending());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Begin { same_fp: bool, lease: u64 },
        Complete { current: bool },
        Abort { current: bool },
        Touch { current: bool, lease: u64 },
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<bool>(), 1u64..100).prop_map(|(same_fp, lease)| Op::Begin { same_fp, lease }),
            any::<bool>().prop_map(|current| Op::Complete { current }),
            any::<bool>().prop_map(|current| Op::Abort { current }),
            (any::<bool>(), 1u64..100).prop_map(|(current, lease)| Op::Touch { current, lease }),
            (0u64..150).prop_map(Op::Tick),
        ]
    }

    proptest! {
        // Against any interleaving: tokens only grow, only the newest holder
        // can act, a completed record never changes, and a live lease is never
        // taken over.
        #[test]
        fn invariants_hold(ops in proptest::collection::vec(op(), 1..60)) {
            let mut t = TokenClock::default();
            let mut now = 1_000u64;
            let mut rec: Option<Record> = None;
            let mut issued: Vec<u64> = vec![];
            for op in ops {
                let before = rec.clone();
                let current = rec.as_ref().map(|r| r.token).unwrap_or(1);
                let stale = issued.iter().copied().find(|&x| x != current).unwrap_or(current + 7);
                match op {
                    Op::Begin { same_fp, lease } => {
                        let r = req(if same_fp { b"a" } else { b"b" }, lease);
                        match begin(rec.as_mut(), &r, || now, || &mut t) {
                            Begin::Created(new) => {
                                prop_assert!(before.is_none());
                                prop_assert!(issued.iter().all(|&x| x < new.token));
                                issued.push(new.token);
                                rec = Some(new);
                            }
                            Begin::TakenOver { token } => {
                                let b = before.unwrap();
                                let lapsed = matches!(b.state, State::InProgress { lease_until } if lease_until <= now);
                                prop_assert!(lapsed);
                                prop_assert!(issued.iter().all(|&x| x < token));
                                issued.push(token);
                            }
                            Begin::InFlight { retry_after_ms } => {
                                prop_assert!(retry_after_ms > 0);
                                prop_assert_eq!(&rec, &before);
                            }
                            Begin::Replay(_) | Begin::Mismatch => prop_assert_eq!(&rec, &before),
                        }
                    }
                    Op::Complete { current: cur } => {
                        let tok = if cur { current } else { stale };
                        let ok = complete(rec.as_mut(), done(tok), now).is_ok();
                        let was_holder = matches!(&before, Some(b) if b.token == tok && b.completed().is_none());
                        prop_assert_eq!(ok, was_holder);
                        if !ok { prop_assert_eq!(&rec, &before); }
                    }
                    Op::Abort { current: cur } => {
                        let tok = if cur { current } else { stale };
                        if may_abort(rec.as_ref(), tok) {
                            prop_assert!(rec.as_ref().unwrap().completed().is_none());
                            rec = None;
                        }
                    }
                    Op::Touch { current: cur, lease } => {
                        let tok = if cur { current } else { stale };
                        if touch(rec.as_mut(), tok, lease, now).is_err() {
                            prop_assert_eq!(&rec, &before);
                        }
                    }
                    Op::Tick(ms) => now += ms,
                }
            }
        }
    }
}
