//! The host tier's blocks: those swapped-out sequences hold and, with a host prefix cache,
//! the cached blocks the device evicted (see `host_prefix`).

use crate::alloc::BlockPool;
use crate::error::CoreResult;
use crate::kv_cache::NO_BLOCK;

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

/// Host blocks for swapped-out sequences (block 0 unused here too) and, with a host prefix
/// cache, for the cached blocks the device evicted; and the scratch a swap plans its moves in.
#[derive(Debug, Clone)]
pub(in crate::kv_cache) struct HostTier {
    pub(in crate::kv_cache) pool: BlockPool,
    /// Source block → destination block while a swap is planned; `NO_BLOCK` elsewhere. As
    /// long as the larger tier, so either tier's blocks index it.
    pub(in crate::kv_cache) scratch_moves: Vec<u32>,
    pub(in crate::kv_cache) prefix_counters: HostPrefixCounters,
}

impl HostTier {
    pub(in crate::kv_cache) fn new(
        num_host_blocks: usize,
        num_device_blocks: usize,
        block_size: usize,
        keep_prefixes: bool,
    ) -> CoreResult<Self> {
        // Named here: the host pool's own error would blame a `num_blocks` nobody passed.
        ensure!(
            num_host_blocks < crate::alloc::MAX_BLOCKS,
            "num_host_blocks = {num_host_blocks} is more than a host tier manages ({})",
            crate::alloc::MAX_BLOCKS - 1
        );
        Ok(HostTier {
            pool: BlockPool::new(num_host_blocks + 1, block_size, keep_prefixes)?,
            scratch_moves: crate::alloc::fallible::try_filled_vec(
                num_device_blocks.max(num_host_blocks + 1),
                NO_BLOCK,
                "num_host_blocks",
            )?,
            prefix_counters: HostPrefixCounters::default(),
        })
    }

    /// That the host blocks are held as `holders` says and no planned move is left over.
    pub(in crate::kv_cache) fn check_invariants(&self, holders: &[u32]) -> Result<(), String> {
        self.pool
            .check_invariants(holders)
            .map_err(|error| format!("host tier: {error}"))?;
        match self.scratch_moves.iter().all(|&moved| moved == NO_BLOCK) {
            true => Ok(()),
            false => Err("swap scratch left dirty".into()),
        }
    }
}
