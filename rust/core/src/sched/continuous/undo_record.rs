//! The scheduler as one step's unit of undo (see `crate::undo`): its requests and queues
//! record their own changes; its lists of ids (as long as what runs) and its counters are
//! kept here when the step begins.
//!
//! Debug builds also keep a whole copy at `begin` and check, at every rollback, that the
//! record put back exactly that.

use std::collections::BTreeSet;
use std::fmt;

use hashbrown::HashMap;

use super::requests::{Request, State};
use super::{ContinuousScheduler, LoadCounters, QueueKey};
use crate::undo::{Saved, Stamp, Undo};

/// The requests by id. Changing one goes through `get_mut`, which records, in a
/// transaction, what the request had before its first change.
#[derive(Clone, Default)]
pub(super) struct RequestTable {
    requests: HashMap<u64, Request>,
    changes: Vec<RequestChange>,
    transaction: Option<u64>,
    next_transaction: u64,
}

#[derive(Clone)]
enum RequestChange {
    Changed(u64, RequestBefore),
    Inserted(u64),
    Removed(u64, Box<Request>),
}

/// A request's fields as a transaction found them; its two vectors only grow in a step.
#[derive(Clone)]
struct RequestBefore {
    state: State,
    queue_key: i64,
    admitted: u64,
    num_outputs: usize,
    num_computed: usize,
    awaiting_token: bool,
    samples_to_fork: usize,
    external_blocks: usize,
    loading_blocks: usize,
    token_ids: usize,
    block_hashes: usize,
}

impl RequestTable {
    #[inline]
    pub(super) fn get(&self, seq_id: &u64) -> Option<&Request> {
        self.requests.get(seq_id)
    }

    #[inline]
    pub(super) fn get_mut(&mut self, seq_id: &u64) -> Option<&mut Request> {
        let request = self.requests.get_mut(seq_id)?;
        if let Some(transaction) = self.transaction {
            if request.changed_in.0 != transaction {
                record_first_change(&mut self.changes, *seq_id, request, transaction);
            }
        }
        Some(request)
    }

    pub(super) fn insert(&mut self, seq_id: u64, mut request: Request) {
        if let Some(transaction) = self.transaction {
            // New in this transaction: a rollback removes it whole.
            request.changed_in = Stamp(transaction);
        }
        let replaced = self.requests.insert(seq_id, request);
        debug_assert!(replaced.is_none(), "request {seq_id} inserted twice");
        if self.transaction.is_some() {
            self.changes.push(RequestChange::Inserted(seq_id));
        }
    }

    pub(super) fn remove(&mut self, seq_id: &u64) -> Option<Request> {
        let request = self.requests.remove(seq_id)?;
        if self.transaction.is_some() {
            let kept = Box::new(request.clone());
            self.changes.push(RequestChange::Removed(*seq_id, kept));
        }
        Some(request)
    }

    pub(super) fn contains_key(&self, seq_id: &u64) -> bool {
        self.requests.contains_key(seq_id)
    }

    pub(super) fn len(&self) -> usize {
        self.requests.len()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Request> + '_ {
        self.requests.values()
    }
}

/// Out of line: the first change of each request in a step, where the hot path is every
/// later lookup.
#[inline(never)]
fn record_first_change(
    changes: &mut Vec<RequestChange>,
    seq_id: u64,
    request: &mut Request,
    transaction: u64,
) {
    request.changed_in = Stamp(transaction);
    let before = RequestBefore {
        state: request.state,
        queue_key: request.queue_key,
        admitted: request.admitted,
        num_outputs: request.num_outputs,
        num_computed: request.num_computed,
        awaiting_token: request.awaiting_token,
        samples_to_fork: request.samples_to_fork,
        external_blocks: request.external_blocks,
        loading_blocks: request.loading_blocks,
        token_ids: request.token_ids.len(),
        block_hashes: request.block_hashes.len(),
    };
    changes.push(RequestChange::Changed(seq_id, before));
}

impl Undo for RequestTable {
    fn begin(&mut self) {
        self.next_transaction += 1;
        self.transaction = Some(self.next_transaction);
    }

    fn commit(&mut self) {
        self.transaction = None;
        self.changes.clear();
    }

    fn rollback(&mut self) {
        while let Some(change) = self.changes.pop() {
            match change {
                RequestChange::Inserted(seq_id) => {
                    self.requests.remove(&seq_id);
                }
                RequestChange::Removed(seq_id, request) => {
                    self.requests.insert(seq_id, *request);
                }
                RequestChange::Changed(seq_id, before) => {
                    let Some(request) = self.requests.get_mut(&seq_id) else {
                        continue; // removed later: put back whole, before this
                    };
                    request.state = before.state;
                    request.queue_key = before.queue_key;
                    request.admitted = before.admitted;
                    request.num_outputs = before.num_outputs;
                    request.num_computed = before.num_computed;
                    request.awaiting_token = before.awaiting_token;
                    request.samples_to_fork = before.samples_to_fork;
                    request.external_blocks = before.external_blocks;
                    request.loading_blocks = before.loading_blocks;
                    request.token_ids.truncate(before.token_ids);
                    request.block_hashes.truncate(before.block_hashes);
                }
            }
        }
        self.transaction = None;
    }
}

impl<'a> IntoIterator for &'a RequestTable {
    type Item = (&'a u64, &'a Request);
    type IntoIter = hashbrown::hash_map::Iter<'a, u64, Request>;

    fn into_iter(self) -> Self::IntoIter {
        self.requests.iter()
    }
}

impl<'a> IntoIterator for &'a Queue {
    type Item = &'a QueueKey;
    type IntoIter = std::collections::btree_set::Iter<'a, QueueKey>;

    fn into_iter(self) -> Self::IntoIter {
        self.keys.iter()
    }
}

/// Printed in id order: a rollback puts back the requests, not their places in the table.
impl fmt::Debug for RequestTable {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut requests: Vec<_> = self.requests.iter().collect();
        requests.sort_unstable_by_key(|&(&seq_id, _)| seq_id);
        formatter.debug_map().entries(requests).finish()
    }
}

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

impl fmt::Debug for Queue {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.keys.fmt(formatter)
    }
}

/// The scheduler's lists of ids and counters as the step found them.
#[derive(Clone, Default)]
pub(super) struct UndoRecord {
    saved: Saved<Counters>,
    running: Vec<u64>,
    loading: Vec<u64>,
    abandoned_loads: Vec<u64>,
    finished_since_plan: Vec<u64>,
    in_flight: Vec<u64>,
    deferred_frees: Vec<u64>,
    #[cfg(debug_assertions)]
    copy: Option<Box<ContinuousScheduler>>,
}

#[derive(Clone, Copy)]
struct Counters {
    load_counters: LoadCounters,
    next_arrival: i64,
    next_front: i64,
    next_admission: u64,
    num_preemptions: u64,
    forked_since_step: usize,
    unforked_samples: usize,
    fork_reserve: usize,
    saved_moves: usize,
}

impl fmt::Debug for UndoRecord {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("_")
    }
}

impl ContinuousScheduler {
    fn counters(&self) -> Counters {
        Counters {
            load_counters: self.load_counters,
            next_arrival: self.next_arrival,
            next_front: self.next_front,
            next_admission: self.next_admission,
            num_preemptions: self.num_preemptions,
            forked_since_step: self.forked_since_step,
            unforked_samples: self.unforked_samples,
            fork_reserve: self.fork_reserve,
            saved_moves: self.saved_moves,
        }
    }

    /// The state a rollback must restore, as text (scratch buffers and the plan's block
    /// table, which describes the caller's buffer as the step left it, left out).
    #[cfg(debug_assertions)]
    fn state_text(&self) -> String {
        format!(
            "{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}",
            self.config,
            self.requests,
            self.waiting,
            self.swapped,
            (&self.running, &self.loading, &self.abandoned_loads),
            self.load_counters,
            (self.next_arrival, self.next_front, self.next_admission),
            (
                self.num_preemptions,
                self.forked_since_step,
                self.unforked_samples
            ),
            (
                &self.finished_since_plan,
                &self.in_flight,
                &self.deferred_frees
            ),
            (self.fork_reserve, self.saved_moves),
        )
    }
}

impl Undo for ContinuousScheduler {
    fn begin(&mut self) {
        #[cfg(debug_assertions)]
        {
            self.undo.copy = Some(Box::new(self.clone()));
        }
        let counters = self.counters();
        let record = &mut self.undo;
        record.saved.save(counters);
        record.running.clone_from(&self.running);
        record.loading.clone_from(&self.loading);
        record.abandoned_loads.clone_from(&self.abandoned_loads);
        record
            .finished_since_plan
            .clone_from(&self.finished_since_plan);
        record.in_flight.clone_from(&self.in_flight);
        record.deferred_frees.clone_from(&self.deferred_frees);
        self.requests.begin();
        self.waiting.begin();
        self.swapped.begin();
    }

    fn commit(&mut self) {
        self.undo.saved.forget();
        #[cfg(debug_assertions)]
        {
            self.undo.copy = None;
        }
        self.requests.commit();
        self.waiting.commit();
        self.swapped.commit();
    }

    fn rollback(&mut self) {
        let Some(counters) = self.undo.saved.take() else {
            return;
        };
        let Counters {
            load_counters,
            next_arrival,
            next_front,
            next_admission,
            num_preemptions,
            forked_since_step,
            unforked_samples,
            fork_reserve,
            saved_moves,
        } = counters;
        self.load_counters = load_counters;
        (self.next_arrival, self.next_front) = (next_arrival, next_front);
        (self.next_admission, self.num_preemptions) = (next_admission, num_preemptions);
        (self.forked_since_step, self.unforked_samples) = (forked_since_step, unforked_samples);
        (self.fork_reserve, self.saved_moves) = (fork_reserve, saved_moves);
        let record = &mut self.undo;
        std::mem::swap(&mut self.running, &mut record.running);
        std::mem::swap(&mut self.loading, &mut record.loading);
        std::mem::swap(&mut self.abandoned_loads, &mut record.abandoned_loads);
        std::mem::swap(
            &mut self.finished_since_plan,
            &mut record.finished_since_plan,
        );
        std::mem::swap(&mut self.in_flight, &mut record.in_flight);
        std::mem::swap(&mut self.deferred_frees, &mut record.deferred_frees);
        self.requests.rollback();
        self.waiting.rollback();
        self.swapped.rollback();
        #[cfg(debug_assertions)]
        if let Some(copy) = self.undo.copy.take() {
            assert_eq!(
                self.state_text(),
                copy.state_text(),
                "the undo record did not restore the scheduler"
            );
        }
    }
}
