//! The prefix cache below the device: cached blocks the device evicts are demoted to the host
//! tier instead of dropped, and a prefix lookup that misses on the device finds them there and
//! promotes them back.
//!
//! The host tier's block pool is a prefix cache of its own: a demoted block is registered
//! there under the same key with no holder, so it sits in the host pool's LRU among the
//! blocks swapped-out sequences hold, and a swap-out that needs room evicts it like any other
//! cached block (swapping wins over keeping prefixes). The tiers are inclusive: a promoted
//! block keeps its host copy, so evicting it from the device again costs no copy.
//!
//! Ordering is what makes this correct, and it is the move list's order: a demotion is
//! planned at the moment its device block is evicted (inside the allocation that evicts it),
//! so its device→host move precedes every move and every kernel that writes the block for
//! its new owner; a promotion's host block is held from the lookup until its host→device
//! move is planned, so no demotion before that can reuse it, and one after is ordered after
//! the move that reads it.

use super::tiers::host_block;
use super::HostPrefixCounters;
use super::KvCache;
use crate::alloc::BlockHash;

impl KvCache {
    /// Whether cached blocks the device evicts go to the host tier.
    pub fn host_prefix_cache(&self) -> bool {
        self.tiers
            .host_tier
            .as_ref()
            .is_some_and(|tier| tier.pool.enable_prefix_caching())
    }

    pub fn host_prefix_counters(&self) -> HostPrefixCounters {
        self.tiers
            .host_tier
            .as_ref()
            .map_or_else(HostPrefixCounters::default, |tier| tier.prefix_counters)
    }

    /// Cached blocks the host tier holds for the prefix cache (no sequence holds them).
    pub fn num_host_cached_blocks(&self) -> usize {
        self.tiers
            .host_tier
            .as_ref()
            .map_or(0, |tier| tier.pool.num_evictable())
    }

    /// The keys of the blocks the host prefix cache holds, in block order.
    pub fn host_cached_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.tiers
            .host_tier
            .iter()
            .flat_map(|tier| tier.pool.cached_hashes())
    }
}

impl KvCache {
    /// Of the first `hits` blocks of the last lookup (`queries` per group row in
    /// `scratch_blocks`), how many some group takes from the host tier.
    pub(super) fn host_hit_blocks(&self, queries: usize, hits: usize) -> usize {
        if !self.host_prefix_cache() {
            return 0;
        }
        (0..hits)
            .filter(|&index| self.host_hit_blocks_at(queries, index))
            .count()
    }

    /// Whether some group takes block `index` of the last lookup from the host tier.
    pub(super) fn host_hit_blocks_at(&self, queries: usize, index: usize) -> bool {
        (0..self.groups.len())
            .any(|group| host_block(self.scratch.blocks[group * queries + index]).is_some())
    }
}
