//! The requests by id, as the scheduler's unit of undo for them (see `crate::undo`): a
//! request's first change in a step keeps the fields it had, and a rollback puts them back.

use std::fmt;

use hashbrown::HashMap;

use super::requests::{Request, State};
use crate::undo::{Stamp, Undo};

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

/// Printed in id order: a rollback puts back the requests, not their places in the table.
impl fmt::Debug for RequestTable {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut requests: Vec<_> = self.requests.iter().collect();
        requests.sort_unstable_by_key(|&(&seq_id, _)| seq_id);
        formatter.debug_map().entries(requests).finish()
    }
}
