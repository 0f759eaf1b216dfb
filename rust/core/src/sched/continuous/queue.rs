//! The waiting and swapped queues: request keys in queue order, recording their inserts and
//! removals in a step (see `crate::undo`).

use std::collections::BTreeSet;
use std::fmt;

use super::QueueKey;
use crate::undo::Undo;

/// A queue of requests in key order, recording its inserts and removals in a transaction.
#[derive(Clone, Default)]
pub(super) struct Queue {
    keys: BTreeSet<QueueKey>,
    /// (inserted, key), newest last.
    changes: Vec<(bool, QueueKey)>,
    recording: bool,
}

impl Queue {
    pub(super) fn insert(&mut self, key: QueueKey) -> bool {
        let inserted = self.keys.insert(key);
        if inserted && self.recording {
            self.changes.push((true, key));
        }
        inserted
    }

    pub(super) fn remove(&mut self, key: &QueueKey) -> bool {
        let removed = self.keys.remove(key);
        if removed && self.recording {
            self.changes.push((false, *key));
        }
        removed
    }

    pub(super) fn first(&self) -> Option<&QueueKey> {
        self.keys.first()
    }

    pub(super) fn contains(&self, key: &QueueKey) -> bool {
        self.keys.contains(key)
    }

    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = &QueueKey> + '_ {
        self.keys.iter()
    }

    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl Undo for Queue {
    fn begin(&mut self) {
        self.recording = true;
    }

    fn commit(&mut self) {
        self.recording = false;
        self.changes.clear();
    }

    fn rollback(&mut self) {
        while let Some((inserted, key)) = self.changes.pop() {
            match inserted {
                true => self.keys.remove(&key),
                false => self.keys.insert(key),
            };
        }
        self.recording = false;
    }
}

impl<'a> IntoIterator for &'a Queue {
    type Item = &'a QueueKey;
    type IntoIter = std::collections::btree_set::Iter<'a, QueueKey>;

    fn into_iter(self) -> Self::IntoIter {
        self.keys.iter()
    }
}

impl fmt::Debug for Queue {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.keys.fmt(formatter)
    }
}
