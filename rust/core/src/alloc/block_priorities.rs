//! Retention priorities of cached blocks (the `priority` eviction policy): what each block
//! was given and until when, on a clock the caller advances.
//!
//! A block that joins the prefix cache takes the priority of the request that computed it;
//! a later request that holds it (a hit) can only raise it, to the highest any request gave.
//! A priority given for a duration falls back to [`DEFAULT_PRIORITY`] when the duration
//! ends: expiries wait in a min-heap, checked when the clock advances, so an expiry costs
//! O(log n) once and nothing while it waits. A block whose priority changed later leaves a
//! stale heap entry behind (its time no longer matches), skipped when it comes up; the heap
//! is compacted when stale entries outnumber the blocks.
//!
//! Nothing is allocated until a request asks for a priority (`keep_priorities`), nor the
//! heap until one asks for a duration (`reserve_expiries`): until then every block is at the
//! default, and the policy — the default one — costs what LRU does, in time and in memory.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::alloc::eviction::{DEFAULT_PRIORITY, MAX_PRIORITY};
use crate::alloc::fallible::{array_bytes, out_of_host_memory, total_bytes, try_filled_vec};
use crate::error::CoreResult;
use crate::undo::{CopyOnChange, Saved, Undo, UndoVec};

/// No expiry: a priority given without a duration.
const NEVER: u64 = u64::MAX;

#[derive(Debug, Clone, Default)]
pub struct BlockPriorities {
    /// Blocks of the pool, kept for the arrays below.
    num_blocks: usize,
    /// Per block; empty until a request asks for a priority.
    priority: UndoVec<u8>,
    /// Per block, when its priority ends (`NEVER` for none).
    expires_at: UndoVec<u64>,
    expiries: BinaryHeap<Reverse<(u64, u32)>>,
    clock: u64,
    /// A heap has no cheap per-entry record: it is copied at its first change in a
    /// transaction (only durations fill it).
    expiries_before: CopyOnChange<BinaryHeap<Reverse<(u64, u32)>>>,
    saved_clock: Saved<u64>,
}

impl BlockPriorities {
    pub fn bytes_for(num_blocks: usize) -> Option<u64> {
        total_bytes(&[
            array_bytes::<u8>(num_blocks),
            array_bytes::<u64>(num_blocks),
        ])
    }

    /// Priorities for `num_blocks` blocks, all at the default (nothing allocated yet).
    pub fn new(num_blocks: usize) -> Self {
        BlockPriorities {
            num_blocks,
            ..BlockPriorities::default()
        }
    }

    /// Allocates the per-block priorities, all at the default, once: called before the
    /// first priority is given. Does nothing for a pool that keeps none.
    pub fn keep_priorities(&mut self) -> CoreResult<()> {
        if self.priority.len() == self.num_blocks {
            return Ok(());
        }
        let what = format!("retention priorities of {} blocks", self.num_blocks);
        let priority = try_filled_vec(self.num_blocks, DEFAULT_PRIORITY, &what)?;
        self.expires_at
            .replace(try_filled_vec(self.num_blocks, NEVER, &what)?);
        self.priority.replace(priority);
        Ok(())
    }

    /// Room for every expiry the heap keeps before compacting, so that giving a priority
    /// for a duration never allocates. Called before the first such priority is given.
    pub fn reserve_expiries(&mut self) -> CoreResult<()> {
        self.keep_priorities()?;
        let most = Self::most_expiries(self.priority.len()) + 1;
        if self.priority.is_empty() || self.expiries.capacity() >= most {
            return Ok(());
        }
        let additional = most - self.expiries.len();
        self.expiries.try_reserve_exact(additional).map_err(|_| {
            out_of_host_memory(
                array_bytes::<Reverse<(u64, u32)>>(most),
                "the retention durations' expiries",
            )
        })
    }

    fn most_expiries(num_blocks: usize) -> usize {
        num_blocks.saturating_mul(2).saturating_add(16)
    }

    #[inline]
    pub fn priority(&self, block: u32) -> u8 {
        self.priority
            .get(block as usize)
            .copied()
            .unwrap_or(DEFAULT_PRIORITY)
    }

    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// New contents: the priority of the request that computed them.
    pub fn reset(&mut self, block: u32) {
        if (block as usize) < self.priority.len() {
            self.priority.set(block as usize, DEFAULT_PRIORITY);
            self.expires_at.set(block as usize, NEVER);
        }
    }

    /// Gives `block` `priority` for `duration_ns` (`None`: until its contents change):
    /// `fresh` contents take it, cached ones only if it is higher than theirs (or as high
    /// and longer). Returns whether the block's priority changed.
    pub fn give(
        &mut self,
        block: u32,
        priority: u8,
        duration_ns: Option<u64>,
        fresh: bool,
    ) -> bool {
        let Some(current) = self.priority.get(block as usize).copied() else {
            return false;
        };
        let priority = priority.min(MAX_PRIORITY);
        let until = match duration_ns {
            Some(duration) => self.clock.saturating_add(duration),
            None => NEVER,
        };
        let expires_at = self.expires_at[block as usize];
        let (priority, until) = match () {
            _ if fresh || priority > current => (priority, until),
            _ if priority == current && until > expires_at => (priority, until),
            _ => return false,
        };
        self.priority.set(block as usize, priority);
        self.expires_at.set(block as usize, until);
        if until != NEVER {
            self.expiries_before.before_change(&self.expiries);
            self.expiries.push(Reverse((until, block)));
            if self.expiries.len() > Self::most_expiries(self.priority.len()) {
                let expires_at = &self.expires_at;
                self.expiries
                    .retain(|&Reverse((at, block))| expires_at[block as usize] == at);
            }
        }
        priority != current
    }

    /// Moves the clock to `now_ns` (never back) and hands each block whose priority ended
    /// to `expired`, its priority back at the default.
    pub fn advance(&mut self, now_ns: u64, mut expired: impl FnMut(u32)) {
        self.clock = self.clock.max(now_ns);
        while let Some(&Reverse((at, block))) = self.expiries.peek() {
            if at > self.clock {
                break;
            }
            self.expiries_before.before_change(&self.expiries);
            self.expiries.pop();
            if self.expires_at[block as usize] == at {
                self.expires_at.set(block as usize, NEVER);
                self.priority.set(block as usize, DEFAULT_PRIORITY);
                expired(block);
            }
        }
    }

    pub fn heap_bytes(&self) -> usize {
        self.priority.capacity()
            + self.expires_at.capacity() * 8
            + self.expiries.capacity() * std::mem::size_of::<Reverse<(u64, u32)>>()
    }
}

impl BlockPriorities {
    /// The parts that record their own changes.
    fn undo_parts(&mut self) -> impl Undo + '_ {
        (
            &mut self.priority,
            &mut self.expires_at,
            self.expiries_before.of(&mut self.expiries),
        )
    }
}

impl Undo for BlockPriorities {
    fn begin(&mut self) {
        self.saved_clock.save(self.clock);
        self.undo_parts().begin();
    }

    fn commit(&mut self) {
        self.saved_clock.forget();
        self.undo_parts().commit();
    }

    fn rollback(&mut self) {
        if let Some(clock) = self.saved_clock.take() {
            self.clock = clock;
        }
        self.undo_parts().rollback();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_rise_and_end_when_their_duration_does() {
        let mut retention = BlockPriorities::new(4);
        assert!(
            !retention.give(1, 10, None, true),
            "nothing kept before it is asked"
        );
        retention.reserve_expiries().unwrap();
        assert_eq!(retention.priority(1), DEFAULT_PRIORITY);
        assert!(
            retention.give(1, 10, None, true),
            "fresh contents take a lower one"
        );
        assert!(!retention.give(1, 5, None, false), "a hit only raises it");
        assert!(retention.give(1, 90, Some(100), false));
        assert!(
            !retention.give(1, 90, Some(50), false),
            "a shorter duration changes nothing"
        );
        let mut expired = Vec::new();
        retention.advance(75, |block| expired.push(block));
        assert!(expired.is_empty(), "still until 100");
        retention.give(1, 90, Some(200), false); // until 275
        retention.advance(150, |block| expired.push(block));
        assert!(expired.is_empty(), "extended to 275");
        retention.advance(100, |block| expired.push(block)); // never back
        assert_eq!(retention.clock(), 150);
        retention.advance(275, |block| expired.push(block));
        assert_eq!(
            (expired, retention.priority(1)),
            (vec![1], DEFAULT_PRIORITY)
        );
        assert!(retention.give(2, 200, None, true));
        assert_eq!(retention.priority(2), MAX_PRIORITY);
    }

    #[test]
    fn stale_expiries_are_compacted() {
        let mut retention = BlockPriorities::new(2);
        retention.reserve_expiries().unwrap();
        let room = retention.expiries.capacity();
        for duration in 1..1000 {
            retention.give(1, 50, Some(duration), false);
        }
        assert!(retention.expiries.len() <= 2 * 2 + 16 + 1);
        assert_eq!(
            retention.expiries.capacity(),
            room,
            "giving never allocated"
        );
        let mut expired = Vec::new();
        retention.advance(10_000, |block| expired.push(block));
        assert_eq!(expired, [1]);
    }

    #[test]
    fn without_priorities_everything_is_default() {
        let mut retention = BlockPriorities::default();
        assert!(!retention.give(3, 100, None, true));
        assert_eq!(retention.priority(3), DEFAULT_PRIORITY);
        retention.advance(5, |_| unreachable!());
    }
}
