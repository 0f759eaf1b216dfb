//! The block pool's retention priorities (see `retention`): given to cached blocks, and
//! ended by the clock.

use super::BlockPool;
use crate::alloc::eviction::DEFAULT_PRIORITY;
use crate::error::CoreResult;

impl BlockPool {
    /// A cached block's retention priority (the default unless the policy keeps them).
    pub fn priority(&self, block: u32) -> u8 {
        self.retention.priority(block)
    }

    /// Gives a cached block a retention priority (see `retention`): `fresh` when its
    /// contents just joined the cache. An unused block moves to its new queue. Nothing
    /// happens unless the policy keeps priorities and `keep_priorities` has run.
    pub fn retain(&mut self, block: u32, priority: u8, duration_ns: Option<u64>, fresh: bool) {
        if !self.is_cached(block) || !self.retention.give(block, priority, duration_ns, fresh) {
            return;
        }
        if self.ref_counts[block as usize] == 0 {
            self.free_queue.remove(block);
            self.enqueue_cached(block);
        }
    }

    /// Allocates what the blocks' priorities take (see `BlockPriorities`), once.
    pub fn keep_priorities(&mut self) -> CoreResult<()> {
        self.retention.keep_priorities()
    }

    /// Reserves what priorities given for a duration take (see `BlockPriorities`), once.
    pub fn reserve_expiries(&mut self) -> CoreResult<()> {
        self.retention.reserve_expiries()
    }

    /// Moves the retention clock to `now_ns`: priorities whose duration ended fall back to
    /// the default, and unused blocks among them go to the head of the default queue (kept
    /// past their time, they are the oldest there).
    pub fn advance_clock(&mut self, now_ns: u64) {
        let BlockPool {
            retention,
            free_queue,
            ref_counts,
            policy,
            hits,
            ..
        } = self;
        retention.advance(now_ns, |block| {
            if ref_counts[block as usize] == 0 && free_queue.contains(block) {
                free_queue.remove(block);
                let queue = policy.queue_for(hits[block as usize], DEFAULT_PRIORITY);
                free_queue.push_front(queue, block);
            }
        });
    }

    /// The retention clock (nanoseconds, as the caller advances it).
    pub fn clock(&self) -> u64 {
        self.retention.clock()
    }
}
