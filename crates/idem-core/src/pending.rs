//! The mirror's outbox index: completed records not yet acknowledged by the
//! Postgres writer, in the order they become available to pull.
//!
//! It holds key names and tokens only; the body stays in the record. A pulled
//! entry is claimed (hidden) until its claim lapses, so several writers can
//! pull side by side and a writer that dies loses nothing.
//!
//! Every `IDEM.COMPLETE` inserts here, so an insert costs one allocation
//! (the key, shared by the map and the queue) and two ordered inserts on
//! integer pairs; entries that become available at the same time keep their
//! insertion order.

use std::collections::hash_map::Entry as Slot;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    token: u64,
    completed_at: u64,
    available_at: u64,
    /// Insertion number: orders entries with equal times.
    seq: u64,
}

#[derive(Debug, Default)]
pub struct PendingIndex {
    by_key: HashMap<Arc<[u8]>, Entry>,
    /// (available_at, seq) → key: what the next pull hands out.
    queue: BTreeMap<(u64, u64), Arc<[u8]>>,
    /// (completed_at, seq): for the age of the oldest pending record.
    age: BTreeSet<(u64, u64)>,
    next_seq: u64,
}

impl PendingIndex {
    /// Adds or replaces the key's entry; it is available at once.
    pub fn insert(&mut self, key: &[u8], token: u64, completed_at: u64) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = Entry {
            token,
            completed_at,
            available_at: 0,
            seq,
        };
        match self.by_key.entry(Arc::from(key)) {
            Slot::Occupied(mut slot) => {
                let old = *slot.get();
                self.age.remove(&(old.completed_at, old.seq));
                let name = self
                    .queue
                    .remove(&(old.available_at, old.seq))
                    .expect("index entries agree");
                self.queue.insert((0, seq), name);
                slot.insert(entry);
            }
            Slot::Vacant(slot) => {
                self.queue.insert((0, seq), slot.key().clone());
                slot.insert(entry);
            }
        }
        self.age.insert((completed_at, seq));
    }

    pub fn remove(&mut self, key: &[u8]) -> bool {
        let Some(e) = self.by_key.remove(key) else {
            return false;
        };
        self.queue.remove(&(e.available_at, e.seq));
        self.age.remove(&(e.completed_at, e.seq));
        true
    }

    pub fn contains_key(&self, key: &[u8]) -> bool {
        self.by_key.contains_key(key)
    }

    pub fn contains(&self, key: &[u8], token: u64) -> bool {
        self.by_key.get(key).is_some_and(|e| e.token == token)
    }

    /// Claims up to `count` available entries until `now + claim_ms`;
    /// returns their keys and tokens, oldest availability first.
    pub fn claim(&mut self, now: u64, count: usize, claim_ms: u64) -> Vec<(Vec<u8>, u64)> {
        self.claim_where(now, count, claim_ms, |_| true)
    }

    /// Like `claim`, for a caller that may see only the keys `visible`
    /// accepts: the others are neither handed out nor claimed.
    pub fn claim_where(
        &mut self,
        now: u64,
        count: usize,
        claim_ms: u64,
        mut visible: impl FnMut(&[u8]) -> bool,
    ) -> Vec<(Vec<u8>, u64)> {
        let picked: Vec<(u64, u64)> = self
            .queue
            .iter()
            .take_while(|((at, _), _)| *at <= now)
            .filter(|(_, key)| visible(key))
            .take(count)
            .map(|(at_seq, _)| *at_seq)
            .collect();
        let until = now.saturating_add(claim_ms);
        picked
            .into_iter()
            .map(|(at, seq)| {
                let key = self
                    .queue
                    .remove(&(at, seq))
                    .expect("picked from the queue");
                let e = self.by_key.get_mut(&key).expect("index entries agree");
                e.available_at = until;
                let token = e.token;
                let name = key.to_vec();
                self.queue.insert((until, seq), key);
                (name, token)
            })
            .collect()
    }

    /// When the next claimed entry becomes available again, if none is now.
    pub fn next_available_at(&self) -> Option<u64> {
        self.next_available_where(|_| true)
    }

    /// Like `next_available_at`, over the entries `visible` accepts only: a
    /// caller limited to some keys waits for those, not for anyone's.
    pub fn next_available_where(&self, mut visible: impl FnMut(&[u8]) -> bool) -> Option<u64> {
        self.queue
            .iter()
            .find(|(_, key)| visible(key))
            .map(|((at, _), _)| *at)
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn oldest_completed_at(&self) -> Option<u64> {
        self.age.first().map(|(at, _)| *at)
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_hide_entries_until_they_lapse() {
        let mut p = PendingIndex::default();
        p.insert(b"a", 1, 10);
        p.insert(b"b", 2, 5);
        assert_eq!(p.oldest_completed_at(), Some(5));
        let first = p.claim(100, 1, 50);
        assert_eq!(first.len(), 1);
        let second = p.claim(100, 10, 50);
        assert_eq!(second.len(), 1);
        assert_ne!(first, second);
        assert!(p.claim(149, 10, 50).is_empty());
        assert_eq!(p.next_available_at(), Some(150));
        assert_eq!(p.claim(150, 10, 50).len(), 2);
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn invisible_entries_are_neither_handed_out_nor_claimed() {
        let mut p = PendingIndex::default();
        p.insert(b"pay:1", 1, 10);
        p.insert(b"secret:1", 2, 11);
        p.insert(b"pay:2", 3, 12);
        let mine = p.claim_where(100, 10, 1_000, |k| k.starts_with(b"pay:"));
        assert_eq!(mine, vec![(b"pay:1".to_vec(), 1), (b"pay:2".to_vec(), 3)]);
        // The real writer still gets the hidden record at once.
        assert_eq!(p.claim(100, 10, 1_000), vec![(b"secret:1".to_vec(), 2)]);
        // A record available now that the restricted caller may not read
        // does not end its wait: it waits for its own claims to lapse; with
        // nothing visible, for nothing.
        p.insert(b"secret:2", 4, 13);
        assert_eq!(p.next_available_at(), Some(0));
        assert_eq!(
            p.next_available_where(|k| k.starts_with(b"pay:")),
            Some(1_100)
        );
        assert_eq!(p.next_available_where(|k| k.starts_with(b"x:")), None);
    }

    #[test]
    fn equal_availability_keeps_insertion_order() {
        let mut p = PendingIndex::default();
        for (i, key) in [b"c", b"a", b"b"].iter().enumerate() {
            p.insert(*key, i as u64 + 1, 7);
        }
        p.insert(b"c", 9, 8); // a newer version goes to the back
        let keys: Vec<Vec<u8>> = p.claim(0, 10, 5).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        assert_eq!(p.oldest_completed_at(), Some(7));
        assert!(p.remove(b"a") && p.remove(b"b"));
        assert_eq!(p.oldest_completed_at(), Some(8));
        assert_eq!(p.next_available_at(), Some(5));
    }

    #[test]
    fn reinsert_replaces_and_remove_forgets() {
        let mut p = PendingIndex::default();
        p.insert(b"a", 1, 10);
        p.claim(0, 1, 1000);
        p.insert(b"a", 2, 20); // newer version: available again
        assert!(p.contains(b"a", 2) && !p.contains(b"a", 1));
        assert_eq!(p.claim(0, 5, 10), vec![(b"a".to_vec(), 2)]);
        assert!(p.remove(b"a"));
        assert!(!p.remove(b"a"));
        assert!(p.is_empty() && p.oldest_completed_at().is_none());
        assert_eq!((p.queue.len(), p.age.len()), (0, 0));
    }
}
