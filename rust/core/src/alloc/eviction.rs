//! Which cached block the prefix cache gives up first, when a block is needed and none is
//! free: SGLang's policy names, each O(1) per operation.
//!
//! The block pool keeps its free blocks in queue 0 of its [`FreeQueue`] and its evictable
//! cached blocks in the queues after it; a policy says which queue a cached block joins when
//! its last holder lets it go (always at the tail: least recently used first within a
//! queue), and eviction takes the head of the first non-empty queue.
//!
//! - `lru`: one queue, least recently used first (vLLM's).
//! - `lfu`: a queue per hit count (saturating at [`LFU_LEVELS`]), the fewest hits first,
//!   least recently used first among equals.
//! - `slru`: segmented LRU. A block hit while cached is *protected*; the others are on
//!   *probation* and go first. At most [`PROTECTED_SHARE`] of the blocks are protected: past
//!   that, the protected LRU block falls back to probation. A scan of one-off prompts then
//!   flushes probation, never a prefix that is reused.
//! - `priority`: a queue per retention priority (0 to [`MAX_PRIORITY`]), the lowest first,
//!   least recently used first within one (TensorRT-LLM's `KvCacheRetentionConfig`). A block
//!   carries the highest priority any request gave it until that priority's duration ends,
//!   then [`DEFAULT_PRIORITY`] (see `retention`). The default: where no request gives a
//!   priority (a retention, or a scheduling priority, which lowers its blocks' retention),
//!   every block is at the default and this is `lru`. The other policies keep no
//!   priorities and refuse a request's retention.
//!
//! The victim is the head of the first non-empty evictable queue, found from the free queue
//! set's bitmap of non-empty queues: O(1) for every policy.

use std::str::FromStr;

use crate::alloc::free_queue::FreeQueue;
use crate::error::CoreError;

/// LFU's queues: hit counts `0..LFU_LEVELS - 1`, and every count from `LFU_LEVELS - 1` on.
pub const LFU_LEVELS: usize = 8;

/// The share of a pool's blocks SLRU keeps protected at most.
pub const PROTECTED_SHARE: f64 = 0.8;

/// Retention priorities run from 0 (evicted first) to this (kept longest).
pub const MAX_PRIORITY: u8 = 100;

/// A block's priority when no request gave it one, or once its duration ended
/// (TensorRT-LLM's default).
pub const DEFAULT_PRIORITY: u8 = 35;

/// The variants are in the order of [`EvictionPolicy::NAMES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    Lru,
    Lfu,
    Slru,
    /// The default: with no request asking for a priority it evicts exactly as `Lru`, and a
    /// request that asks for retention gets it.
    #[default]
    Priority,
}

impl EvictionPolicy {
    pub const ALL: [EvictionPolicy; 4] = [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::Slru,
        EvictionPolicy::Priority,
    ];

    /// Every policy's name, in the order of [`EvictionPolicy::ALL`]: the one list of them,
    /// which the bindings export and an unknown name's error shows.
    pub const NAMES: [&'static str; 4] = ["lru", "lfu", "slru", "priority"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|policy| policy.name() == name)
    }

    /// Queues of the free queue set: the free blocks' and the evictable ones'.
    pub(crate) fn queues(self) -> usize {
        1 + match self {
            EvictionPolicy::Lru => 1,
            EvictionPolicy::Lfu => LFU_LEVELS,
            EvictionPolicy::Slru => 2,
            EvictionPolicy::Priority => usize::from(MAX_PRIORITY) + 1,
        }
    }

    /// The queue an unused cached block hit `hits` times since it was cached, of retention
    /// `priority`, joins.
    #[inline]
    pub(crate) fn queue_for(self, hits: u8, priority: u8) -> usize {
        match self {
            EvictionPolicy::Lru => 1,
            EvictionPolicy::Lfu => 1 + usize::from(hits).min(LFU_LEVELS - 1),
            EvictionPolicy::Slru => 1 + usize::from(hits > 0),
            EvictionPolicy::Priority => 1 + usize::from(priority.min(MAX_PRIORITY)),
        }
    }

    /// Keeps the protected segment within its share (SLRU): its least recently used blocks
    /// fall back to probation, as the most recently used there.
    #[inline]
    pub(crate) fn rebalance(self, queue: &mut FreeQueue, num_blocks: usize) {
        if self != EvictionPolicy::Slru {
            return;
        }
        let most = (num_blocks as f64 * PROTECTED_SHARE) as usize;
        while queue.len_of(2) > most {
            if let Some(block) = queue.pop_front(2) {
                queue.push_back(1, block);
            }
        }
    }

    /// The cached block to give up now: the head of the first non-empty evictable queue.
    #[inline]
    pub(crate) fn victim(self, queue: &FreeQueue) -> Option<u32> {
        queue.front(queue.first_nonempty_from(1)?)
    }
}

/// A policy by its name; an unknown name's error lists [`EvictionPolicy::NAMES`].
impl FromStr for EvictionPolicy {
    type Err = CoreError;

    fn from_str(name: &str) -> Result<Self, CoreError> {
        Self::from_name(name).ok_or_else(|| {
            invalid!(
                "unknown eviction_policy '{name}': one of {}",
                Self::NAMES.join(", ")
            )
        })
    }
}
