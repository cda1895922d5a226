//! `IDEM.BEGIN ... WAIT ms`: duplicates block on the key instead of getting
//! `in_flight`, and are answered when the holder's fate is known.
//!
//! Redis 7.0 only wakes key-blocked clients while the key exists, so the
//! waiter lists are our own: per (db, key), oldest first. `settle` looks at
//! the record and answers: completed → every waiter replays; holder gone
//! (aborted, lease lapsed, key deleted/expired/flushed) → the first waiter
//! takes over as a normal BEGIN would; lease alive → a timer re-checks when
//! it lapses. Every blocked client is unblocked exactly once, by whoever
//! takes it out of the registry first: `settle`, its own deadline timer
//! (`blocked` explains why not Redis' timeout), or its disconnect.
//!
//! A takeover writes and propagates, so it runs inside a command or from the
//! lease timer; while clients are paused the timer only re-arms itself (Redis
//! asserts that nothing is propagated during a pause).

use std::collections::{BTreeMap, VecDeque};

use crate::ffi::blocked::{BlockedClient, Blocking, Timer};
use crate::ffi::call::{guard, Call};
use crate::ffi::ctx::{now_ms, writes_paused, Ctx, Name};
use crate::ffi::key::Key;
use crate::{effects, stats, Shared, TOKENS};
use idem_core::engine::{self, Begin};
use idem_core::wire::ReplayLayout;
use idem_core::{args, wire, Completed, Error, Fingerprint, State};

/// How often a lease timer that found clients paused looks again.
const PAUSED_RETRY_MS: u64 = 10;

struct Waiter {
    id: u64,
    bc: BlockedClient<Waiting>,
    /// Answers `in_flight` when the client's `WAIT` runs out.
    deadline: Timer<u64>,
    fingerprint: Fingerprint,
    ttl_ms: u64,
    lease_ms: u64,
    replay: ReplayLayout,
}

/// The layout argument of answers that carry no replay (it is not read).
const FIELDS: ReplayLayout = ReplayLayout::Fields;

#[derive(Default)]
struct KeyWaiters {
    queue: VecDeque<Waiter>,
    /// The pending lease timer and when it fires.
    timer: Option<(Timer<KeyId>, u64)>,
}

type KeyId = (i32, Vec<u8>);

struct Registry {
    keys: BTreeMap<KeyId, KeyWaiters>,
    /// The key each waiter (by id) waits on.
    owner: BTreeMap<u64, KeyId>,
    next_id: u64,
}

static WAITERS: Shared<Registry> = Shared::new(Registry {
    keys: BTreeMap::new(),
    owner: BTreeMap::new(),
    next_id: 1,
});

/// What a woken waiter is answered.
enum Answer {
    New(u64),
    Replay(Completed, ReplayLayout),
    Mismatch,
    InFlight(u64),
    Error(Error),
}

pub fn has(db: i32, key: &[u8]) -> bool {
    let all = WAITERS.lock();
    !all.keys.is_empty() && all.keys.contains_key(&(db, key.to_vec()))
}

pub fn count() -> usize {
    WAITERS.lock().owner.len()
}

/// Blocks the calling client as a waiter on its key. Returns false (the
/// caller answers `in_flight` at once) where blocking is not allowed: inside
/// MULTI, Lua, or a context that denies blocking.
pub fn wait(call: &Call, req: &args::Begin, lease_until: u64) -> bool {
    let Some(wait_ms) = req.wait_ms.filter(|_| call.ctx.may_wait()) else {
        return false;
    };
    let bc = BlockedClient::block(call.ctx);
    let key_id = (call.ctx.db(), req.key.to_vec());
    let mut all = WAITERS.lock();
    let id = all.next_id;
    all.next_id += 1;
    let deadline = Timer::start(call.ctx, wait_ms, id, on_deadline);
    all.owner.insert(id, key_id.clone());
    let entry = all.keys.entry(key_id.clone()).or_default();
    entry.queue.push_back(Waiter {
        id,
        bc,
        deadline,
        fingerprint: req.fingerprint,
        ttl_ms: req.ttl_ms,
        lease_ms: req.lease_ms,
        replay: req.replay,
    });
    arm_timer(call.ctx, entry, &key_id, lease_until);
    true
}

/// Makes sure a timer re-checks the key no later than `at`.
fn arm_timer(ctx: Ctx, entry: &mut KeyWaiters, id: &KeyId, at: u64) {
    if let Some((timer, fires_at)) = entry.timer {
        if fires_at <= at {
            return;
        }
        stop_timer(ctx, timer);
    }
    let delay = at.saturating_sub(now_ms());
    entry.timer = Some((
        Timer::start(ctx, delay, id.clone(), on_timer),
        now_ms() + delay,
    ));
}

fn stop_timer(ctx: Ctx, timer: Timer<KeyId>) {
    timer.stop(ctx);
}

fn on_timer(ctx: Ctx, id: KeyId) {
    guard("wait timer", (), || {
        {
            let mut all = WAITERS.lock();
            let Some(entry) = all.keys.get_mut(&id) else {
                return;
            };
            entry.timer = None;
            if writes_paused() {
                arm_timer(ctx, entry, &id, now_ms() + PAUSED_RETRY_MS);
                return;
            }
        }
        ctx.select_db(id.0);
        settle_from(ctx, id.0, &id.1, Routed::No);
    })
}

/// A waiter's `WAIT` ran out: it gets `in_flight`, unless it was answered.
fn on_deadline(ctx: Ctx, id: u64) {
    guard("wait deadline", (), || {
        let Some((waiter, (db, key))) =
            take(ctx, |all| all.owner.get(&id).cloned(), |w| w.id == id)
        else {
            return; // answered, or disconnected, already
        };
        ctx.select_db(db);
        let name = ctx.string(&key);
        let retry_after = match Key::inspect(ctx, name.name()).record() {
            Ok(Some(r)) => lease_end(&r.state).saturating_sub(now_ms()),
            _ => 0,
        };
        stats::IN_FLIGHT.incr();
        stats::WAITS_TIMEOUT.incr();
        answer(waiter.bc, Answer::InFlight(retry_after.max(1)));
    })
}

/// Removes the waiter `pick` accepts from the registry, with its key:
/// looked for under the key `key_of` names, else under every key. The last
/// waiter of a key takes the key's entry and lease timer with it (`take`
/// runs on a deadline or a disconnect, never in that lease timer).
fn take(
    ctx: Ctx,
    key_of: impl FnOnce(&Registry) -> Option<KeyId>,
    mut pick: impl FnMut(&Waiter) -> bool,
) -> Option<(Waiter, KeyId)> {
    let mut all = WAITERS.lock();
    let key_id = match key_of(&all) {
        Some(k) => k,
        None => all
            .keys
            .iter()
            .find(|(_, e)| e.queue.iter().any(&mut pick))
            .map(|(k, _)| k.clone())?,
    };
    let entry = all.keys.get_mut(&key_id)?;
    let pos = entry.queue.iter().position(pick)?;
    let waiter = entry.queue.remove(pos)?;
    all.owner.remove(&waiter.id);
    forget_if_idle(ctx, &mut all, &key_id);
    Some((waiter, key_id))
}

/// The key was deleted, expired, renamed or restored: settle from a timer,
/// since keyspace callbacks must not write.
pub fn key_gone(ctx: Ctx, db: i32, key: &[u8]) {
    let id = (db, key.to_vec());
    if let Some(entry) = WAITERS.lock().keys.get_mut(&id) {
        arm_timer(ctx, entry, &id, 0);
    }
}

/// The contents of databases changed wholesale (FLUSHDB/FLUSHALL: `db < 0`
/// for all; SWAPDB): every waiter there looks at its key again, soon.
pub fn recheck_dbs(ctx: Ctx, dbs: &[i32]) {
    let mut all = WAITERS.lock();
    for (id, entry) in all
        .keys
        .iter_mut()
        .filter(|(id, _)| dbs.iter().any(|&db| db < 0 || db == id.0))
    {
        arm_timer(ctx, entry, id, 0);
    }
}

/// Answers the waiters of `key` as far as its record allows (see module
/// docs), from a command cluster routing sent here for the key.
pub fn settle(ctx: Ctx, db: i32, key: &[u8]) {
    settle_from(ctx, db, key, Routed::Yes);
}

/// Whether cluster routing checked that this node serves the key: yes in a
/// command on it, no in a timer. A key gone from a cluster node may have
/// left with its slot (`MIGRATE` deletes it here, with a `del` event).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Routed {
    Yes,
    No,
}

fn settle_from(ctx: Ctx, db: i32, key: &[u8], routed: Routed) {
    if !has(db, key) {
        return;
    }
    let id = (db, key.to_vec());
    settle_named(ctx, &id, ctx.string(key).name(), routed);
    forget_if_idle(ctx, &mut WAITERS.lock(), &id);
}

/// Drops the key's entry and its lease timer once nobody waits on it.
fn forget_if_idle(ctx: Ctx, all: &mut Registry, id: &KeyId) {
    if all.keys.get(id).is_some_and(|e| e.queue.is_empty()) {
        if let Some((timer, _)) = all.keys.remove(id).and_then(|e| e.timer) {
            stop_timer(ctx, timer);
        }
    }
}

fn settle_named(ctx: Ctx, id: &KeyId, name: Name, routed: Routed) {
    let key = &id.1[..];
    loop {
        let Some(waiter) = WAITERS
            .lock()
            .keys
            .get_mut(id)
            .and_then(|e| e.queue.pop_front())
        else {
            break;
        };
        let req = args::Begin {
            key,
            fingerprint: waiter.fingerprint,
            ttl_ms: waiter.ttl_ms,
            lease_ms: waiter.lease_ms,
            wait_ms: None,
            replay: waiter.replay,
        };
        // Taken out below to be answered, or put back to wait on.
        let mut waiter = Some(waiter);
        let mut handle = Key::open(ctx, name);
        let record = match handle.record() {
            Ok(r) => r,
            Err(e) => {
                drop(handle);
                if let Some(w) = waiter.take() {
                    finish(ctx, w, Answer::Error(e));
                }
                continue;
            }
        };
        // No record, no routing: in a cluster the key may live on another
        // node now (its holder's record with it), and a record made here
        // would be a second holder in a slot this node may no longer serve.
        // The waiter asks again, and routing finds the key's node.
        if record.is_none() && routed == Routed::No && ctx.in_cluster() {
            drop(handle);
            if let Some(w) = waiter.take() {
                stats::IN_FLIGHT.incr();
                finish(ctx, w, Answer::InFlight(1));
            }
            continue;
        }
        let answer_now = match engine::begin(record, &req, now_ms, || TOKENS.lock()) {
            Begin::Created(record) => {
                effects::replicate_put_always(ctx, name, &record);
                let (token, lease_until) = (record.token, lease_end(&record.state));
                handle.store(record);
                Some((Answer::New(token), Some(lease_until)))
            }
            Begin::TakenOver { token } => match handle.signal_then_record() {
                Ok(Some(record)) => {
                    effects::replicate_put_always(ctx, name, record);
                    stats::TAKEOVERS.incr();
                    Some((Answer::New(token), Some(lease_end(&record.state))))
                }
                _ => Some((Answer::Error(Error::NotFound), None)),
            },
            Begin::InFlight { retry_after_ms } => match WAITERS.lock().keys.get_mut(id) {
                Some(entry) => {
                    if let Some(w) = waiter.take() {
                        entry.queue.push_front(w);
                        arm_timer(ctx, entry, id, now_ms() + retry_after_ms);
                    }
                    None
                }
                // The key's entry outlives the settling of its queue; were
                // it gone, the waiter is answered, not dropped unanswered.
                None => Some((Answer::InFlight(retry_after_ms.max(1)), None)),
            },
            Begin::Replay(c) => Some((Answer::Replay(c.clone(), req.replay), None)),
            Begin::Mismatch => Some((Answer::Mismatch, None)),
        };
        drop(handle);
        let Some((reply, lease_until)) = answer_now else {
            break;
        };
        if matches!(reply, Answer::New(_)) {
            stats::NEW.incr();
            stats::WAITS_TAKEOVER.incr();
        }
        if let Some(w) = waiter.take() {
            finish(ctx, w, reply);
        }
        if let Some(at) = lease_until {
            // The new holder's lease: the rest wait on it.
            if let Some(entry) = WAITERS.lock().keys.get_mut(id) {
                arm_timer(ctx, entry, id, at);
            }
            break;
        }
    }
}

/// Answers a waiter taken off its queue: it leaves the registry, its
/// deadline timer stops.
fn finish(ctx: Ctx, waiter: Waiter, reply: Answer) {
    WAITERS.lock().owner.remove(&waiter.id);
    waiter.deadline.stop(ctx);
    answer(waiter.bc, reply);
}

fn lease_end(state: &State) -> u64 {
    match state {
        State::InProgress { lease_until } => *lease_until,
        State::Completed(_) => 0,
    }
}

fn answer(bc: BlockedClient<Waiting>, answer: Answer) {
    if matches!(answer, Answer::Replay(..)) {
        stats::WAITS_REPLAY.incr();
        stats::REPLAY.incr();
    }
    bc.unblock(Some(answer));
}

/// The blocked `IDEM.BEGIN ... WAIT` clients.
struct Waiting;

impl Blocking for Waiting {
    type Answer = Answer;
    const WHAT: &'static str = "wait reply";

    fn reply(ctx: Ctx, _args: &[&[u8]], answer: &Answer) {
        let mut reply = ctx.reply();
        match answer {
            Answer::New(token) => wire::Begin::New { token: *token }.write(&mut reply, FIELDS),
            Answer::Replay(c, layout) => wire::Begin::Replay(c).write(&mut reply, *layout),
            Answer::Mismatch => wire::Begin::Mismatch.write(&mut reply, FIELDS),
            Answer::InFlight(ms) => wire::Begin::InFlight {
                retry_after_ms: *ms,
            }
            .write(&mut reply, FIELDS),
            Answer::Error(e) => reply.error(e),
        }
    }

    fn disconnected(ctx: Ctx, bc: BlockedClient<Waiting>) {
        // Not in the registry: already answered, and so already unblocked.
        if let Some((waiter, _)) = take(ctx, |_| None, |w| w.bc == bc) {
            waiter.deadline.stop(ctx);
            bc.unblock(None);
        }
    }
}
