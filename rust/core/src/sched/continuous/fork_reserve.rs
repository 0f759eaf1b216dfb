//! Blocks kept for the forks to come. A request of `n` samples forks them at its first
//! token, and each fork copies the parent's recurrent states into blocks of its own, taken
//! then, outside any step: were they not kept free from the admission on, a busy cache would
//! have none left and the fork would fail. So admission counts them, and while a request
//! waits for its first token no other sequence takes them: a decode or a prefill that needs
//! them preempts, an admission or a swap-in waits. (K/V needs nothing here: a fork shares
//! the parent's blocks, and the copy-on-write of a shared block is a decode's, which may
//! preempt.)
//!
//! The reserve is summed at each step's start (a walk over the running sequences only while
//! some request has samples to fork and the model has states) and kept up to date through
//! the step.

use super::requests::Request;
use super::ContinuousScheduler;
use crate::kv_cache::KvCache;

impl ContinuousScheduler {
    /// State blocks the forks of `request`'s samples will take.
    pub(super) fn fork_blocks(request: &Request, cache: &KvCache) -> usize {
        request.samples_to_fork * cache.num_state_blocks()
    }

    /// The blocks the admitted requests' forks will take.
    pub(super) fn blocks_for_forks(&self, cache: &KvCache) -> usize {
        if self.unforked_samples == 0 || cache.num_state_blocks() == 0 {
            return 0;
        }
        self.running
            .iter()
            .chain(&self.loading)
            .filter_map(|id| self.requests.get(id))
            .map(|request| Self::fork_blocks(request, cache))
            .sum()
    }

    /// Blocks a sequence may take now: free or evictable ones, less the forks' reserve.
    pub(super) fn free_blocks(&self, cache: &KvCache) -> usize {
        cache.num_free_blocks().saturating_sub(self.fork_reserve)
    }
}
