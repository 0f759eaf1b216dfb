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

use super::state_checkpoints::is_checkpoint_key;
use super::swap::HostTier;
use super::{KvCache, KvEventLog, NO_BLOCK};
use crate::alloc::{BlockHash, BlockPool};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::{BlockMove, MoveKind};

/// Marks a prefix-lookup result that is a host block: `HOST_HIT | host_block`. Block ids stay
/// below `MAX_BLOCKS` (under 2**25), so the bit is free.
pub(super) const HOST_HIT: u32 = 1 << 31;

/// Counters of the host prefix tier since construction, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostPrefixCounters {
    /// Device evictions whose block went to the host tier (a copy was planned).
    pub demoted: u64,
    /// Device evictions whose contents the host tier held already (no copy).
    pub demotions_skipped: u64,
    /// Device evictions dropped because every host block was held by swapped sequences.
    pub demotions_dropped: u64,
    /// Host blocks brought back to the device by a prefix hit.
    pub promoted: u64,
}

/// Allocates a device block for a sequence. If that evicts a cached block and a host prefix
/// tier is on, the block's contents are demoted first: a (device → host) move is planned
/// before anything can write the block again (see the module docs). A block of a state
/// checkpoint is not: hits resume only from checkpoints on the device.
#[inline]
pub(super) fn allocate_device(
    block_pool: &mut BlockPool,
    host_tier: Option<&mut HostTier>,
    moves: &mut Vec<BlockMove>,
    events: &mut KvEventLog,
) -> CoreResult<u32> {
    // Callers check the budget first; this is a guard, not a code path.
    let (block, evicted) = block_pool
        .allocate_evicting()
        .ok_or_else(CoreError::no_block)?;
    if let (Some(key), Some(tier)) = (evicted, host_tier) {
        if tier.pool.enable_prefix_caching() && !is_checkpoint_key(key) {
            demote(tier, moves, events, block, key);
        }
    }
    Ok(block)
}

/// Keeps a copy of evicted device block `block`, cached under `key`, in the host tier.
fn demote(
    tier: &mut HostTier,
    moves: &mut Vec<BlockMove>,
    events: &mut KvEventLog,
    block: u32,
    key: BlockHash,
) {
    let HostTier {
        pool,
        prefix_counters: counters,
        ..
    } = tier;
    if let Some(copy) = pool.lookup(key) {
        pool.touch(copy);
        counters.demotions_skipped += 1;
        return;
    }
    let Some(copy) = pool.allocate() else {
        counters.demotions_dropped += 1;
        return;
    };
    if events.enabled() {
        // The copy this evicted leaves the host first: a block holds one name at a time.
        pool.drain_removed(|_, evicted| events.host_block_freed(evicted));
        events.demoted(block, copy);
    }
    moves.push(BlockMove::new(MoveKind::ToHost, block, copy));
    // Registered before its bytes arrive: moves run in order, so anything that reads the
    // copy (a promotion) is planned, and runs, after this move.
    pool.register(copy, key, false);
    pool.release(copy);
    counters.demoted += 1;
}

impl KvCache {
    /// Whether cached blocks the device evicts go to the host tier.
    pub fn host_prefix_cache(&self) -> bool {
        self.host_tier
            .as_ref()
            .is_some_and(|tier| tier.pool.enable_prefix_caching())
    }

    pub fn host_prefix_counters(&self) -> HostPrefixCounters {
        self.host_tier
            .as_ref()
            .map_or_else(HostPrefixCounters::default, |tier| tier.prefix_counters)
    }

    /// Cached blocks the host tier holds for the prefix cache (no sequence holds them).
    pub fn num_host_cached_blocks(&self) -> usize {
        self.host_tier
            .as_ref()
            .map_or(0, |tier| tier.pool.num_evictable())
    }

    /// The keys of the blocks the host prefix cache holds, in block order.
    pub fn host_cached_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.host_tier
            .iter()
            .flat_map(|tier| tier.pool.cached_hashes())
    }

    /// Where the prefix cache holds `key`: `Some(block)` on the device, `Some(HOST_HIT |
    /// block)` on the host tier, `None` on neither.
    #[inline]
    pub(super) fn lookup_tiers(&self, key: BlockHash) -> Option<u32> {
        if let Some(block) = self.block_pool.lookup(key) {
            return Some(block);
        }
        let tier = self.host_tier.as_ref()?;
        tier.pool.lookup(key).map(|block| block | HOST_HIT)
    }
}

/// The host block of a lookup result that came from the host tier.
#[inline]
pub(super) fn host_block(hit: u32) -> Option<u32> {
    (hit & HOST_HIT != 0 && hit != NO_BLOCK).then_some(hit & !HOST_HIT)
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
            .any(|group| host_block(self.scratch_blocks[group * queries + index]).is_some())
    }
}
