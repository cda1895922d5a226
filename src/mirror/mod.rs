//! The mirror's side of the module: the per-database outbox of completed
//! records not yet in Postgres (here), `IDEM.MIRROR.PULL` / `ACK` (`pull`),
//! and keeping the outbox true when keys change behind idem's back
//! (`events`).

pub mod events;
pub mod pull;

use std::collections::BTreeMap;

use idem_core::pending::PendingIndex;
use idem_core::Record;

use crate::ffi::ctx::now_ms;
use crate::{Shared, TOKENS};

/// Pending records by database.
static PENDING: Shared<BTreeMap<i32, PendingIndex>> = Shared::new(BTreeMap::new());

/// Brings the outbox in line with `record`, now stored under `key`.
pub fn track(db: i32, key: &[u8], record: &Record) {
    match record.completed() {
        Some(c) if record.mirror_pending() => {
            PENDING
                .lock()
                .entry(db)
                .or_default()
                .insert(key, record.token, c.completed_at);
            pull::wake_pullers(db, key);
        }
        _ => forget(db, key),
    }
}

pub fn forget(db: i32, key: &[u8]) {
    if let Some(index) = PENDING.lock().get_mut(&db) {
        index.remove(key);
    }
}

/// Called for each record read by rdb_load, with its key and database where
/// Redis says. Redis may still throw the value away afterwards, without an
/// event: a primary's load (RDB, full sync, DEBUG RELOAD) drops keys already
/// expired, and RESTORE (MIGRATE too) drops a value whose TTL has passed. So
/// a load tracks only records that have not expired, and RESTORE none: its
/// `restore` event tracks what it really stored (`events`).
pub fn loaded(key_and_db: Option<(&[u8], i32)>, record: &Record, loading: bool) {
    let now = now_ms();
    TOKENS.lock().observe(record.token, now);
    if !loading || record.expires_at <= now {
        return;
    }
    if let Some((key, db)) = key_and_db.filter(|_| record.mirror_pending()) {
        track(db, key, record);
    }
}

/// (pending records, completion time of the oldest) over all databases.
pub fn summary() -> (usize, Option<u64>) {
    let pending = PENDING.lock();
    let count = pending.values().map(PendingIndex::len).sum();
    let oldest = pending
        .values()
        .filter_map(PendingIndex::oldest_completed_at)
        .min();
    (count, oldest)
}

fn is_tracked(db: i32, key: &[u8]) -> bool {
    PENDING.lock().get(&db).is_some_and(|i| i.contains_key(key))
}

/// Drops the outbox of one database, or of all (`db < 0`).
fn flushed(db: i32) {
    let mut pending = PENDING.lock();
    if db < 0 {
        pending.clear();
    } else {
        pending.remove(&db);
    }
}

/// `SWAPDB a b`: the two datasets trade numbers, and so do their outboxes.
fn swapped(a: i32, b: i32) {
    let mut pending = PENDING.lock();
    let (from_a, from_b) = (pending.remove(&a), pending.remove(&b));
    if let Some(index) = from_a {
        pending.insert(b, index);
    }
    if let Some(index) = from_b {
        pending.insert(a, index);
    }
}

/// Runs `f` on the outbox of `db`, if it has one.
fn with_index<T>(db: i32, f: impl FnOnce(&mut PendingIndex) -> T) -> Option<T> {
    PENDING.lock().get_mut(&db).map(f)
}
