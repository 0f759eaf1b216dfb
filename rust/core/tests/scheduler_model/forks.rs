//! Forks in the scheduler model: behind the scheduler's back (the cache's own `fork`, as a
//! runner sharing a prefix might), and a request's samples forked at its first token.

use atb_mem_core::CoreError;

use super::state::state;
use super::Harness;

impl Harness {
    /// Forks a running sequence through the cache alone. A fork shares the K/V but takes
    /// blocks for its own states: with states it can run out of blocks, and then it changes
    /// nothing.
    pub(super) fn fork_behind_its_back(&mut self, pick: usize) {
        let running: Vec<u64> = self
            .live_requests()
            .into_iter()
            .filter(|&id| self.cache.contains(id) && !self.cache.is_swapped(id).unwrap())
            .collect();
        if let Some(&parent) = running.get(pick % running.len().max(1)) {
            let child = 1_000_000 + self.next_id;
            self.next_id += 1;
            let before = state(&self.scheduler, &self.cache);
            match self.cache.fork(parent, child) {
                Ok(()) => self.forks.push(child),
                Err(CoreError::OutOfBlocks { .. }) if self.cache.num_state_blocks() > 0 => {
                    assert_eq!(state(&self.scheduler, &self.cache), before);
                }
                Err(error) => panic!("fork {parent} → {child}: {error}"),
            }
        }
    }

    /// Forks a sampled request with known ids (a counted prompt's values name its sequence,
    /// so a child could not hold them). It must work exactly when the parent still runs on
    /// the device, awaiting its token.
    pub(super) fn fork_request(&mut self, pick: usize) {
        let sampled = &self.plan.sample_seq_ids;
        let Some(&parent) = sampled.get(pick % sampled.len().max(1)) else {
            return;
        };
        let Some(ids) = self
            .ids
            .get(&parent)
            .filter(|ids| ids[0].is_some())
            .cloned()
        else {
            return;
        };
        let on_device = self.cache.contains(parent) && !self.cache.is_swapped(parent).unwrap();
        let child = self.next_id;
        self.next_id += 1;
        let before = state(&self.scheduler, &self.cache);
        let forked = self.scheduler.fork(&mut self.cache, parent, child);
        let planned = self.planned_forks.get(&parent).copied().unwrap_or(0);
        if let Err(CoreError::OutOfBlocks { .. }) = forked {
            // An unplanned child's states need blocks of their own; a planned one's were kept,
            // unless forks behind the scheduler's back took them.
            assert!(
                self.cache.num_state_blocks() > 0 && (planned == 0 || !self.forks.is_empty()),
                "fork of {parent} ({planned} planned): {forked:?}"
            );
            assert_eq!(state(&self.scheduler, &self.cache), before);
            return;
        }
        assert_eq!(forked.is_ok(), on_device, "fork of {parent}: {forked:?}");
        if forked.is_ok() {
            self.planned_forks.insert(parent, planned.saturating_sub(1));
            self.ids.insert(child, ids);
            self.plan.sample_seq_ids.push(child);
            self.counts.forked_requests += 1;
        }
    }
}
