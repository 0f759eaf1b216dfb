//! Counters, sizes and fragmentation of the cache, and the bookkeeping's own memory.

use super::{HostPrefixCounters, KvCache, Medium, MissReason};
use crate::alloc::{PrefixCacheCounters, NULL_BLOCK};
use crate::error::CoreResult;
use crate::figures::{Figure, Figures};

/// Counters and sizes reported by [`KvCache::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvCacheStats {
    pub num_blocks: usize,
    pub block_size: usize,
    pub blocks_used: usize,
    pub blocks_free: usize,
    pub blocks_cached: usize,
    pub num_sequences: usize,
    pub num_tokens: usize,
    pub allocated_slots: usize,
    pub used_slots: usize,
    pub fragmentation: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prefix_cache_query_tokens: u64,
    pub prefix_cache_hit_tokens: u64,
    pub evictions: u64,
    pub pending_copies: usize,
    pub bytes_per_block: usize,
    /// Usable host blocks (0 without a host tier).
    pub host_blocks: usize,
    pub host_blocks_used: usize,
    pub num_swapped: usize,
    /// Cached blocks the host tier keeps for the prefix cache (no sequence holds them).
    pub host_blocks_cached: usize,
    /// Of `prefix_cache_hit_tokens`, those promoted from the host tier.
    pub prefix_cache_host_hit_tokens: u64,
    /// Of `prefix_cache_hit_tokens`, those copied from a block a prompt shares only the
    /// first pieces of (`hash_block_size`).
    pub prefix_cache_partial_hit_tokens: u64,
    /// Of `prefix_cache_hit_tokens`, those loaded from the disk, and from a store, as the
    /// engine's tier connector reports its loads (`record_tier_hits`).
    pub prefix_cache_disk_hit_tokens: u64,
    pub prefix_cache_store_hit_tokens: u64,
    /// What the host prefix tier did, in blocks.
    pub host_prefix: HostPrefixCounters,
    /// Admissions whose prefix hit fell short, indexed by [`MissReason`] (the
    /// `MissReason::COUNTED` ones).
    pub prefix_cache_misses: [u64; 6],
    /// Checkpoints of recurrent states kept (see `state_checkpoints`), and those dropped
    /// because their copies failed.
    pub state_checkpoints_saved: u64,
    pub state_checkpoints_failed: u64,
    /// KV-cache groups (1 without layer types).
    pub num_groups: usize,
}

impl KvCacheStats {
    /// Prefix-cache hits per lookup (0 before the first lookup).
    pub fn prefix_cache_hit_rate(&self) -> f64 {
        match self.prefix_cache_queries {
            0 => 0.0,
            queries => self.prefix_cache_hits as f64 / queries as f64,
        }
    }

    /// Bytes of K/V the blocks hold in all, the null block included.
    pub fn bytes_total(&self) -> u128 {
        self.bytes_per_block as u128 * self.num_blocks as u128
    }
}

impl Figures for KvCacheStats {
    fn figures(&self) -> Vec<(&'static str, Figure)> {
        figures![
            "num_blocks" => self.num_blocks,
            "block_size" => self.block_size,
            "blocks_total" => self.num_blocks,
            // The null block: padding in block tables, never handed out.
            "blocks_reserved" => 1usize,
            "blocks_used" => self.blocks_used,
            "blocks_free" => self.blocks_free,
            "blocks_cached" => self.blocks_cached,
            "num_sequences" => self.num_sequences,
            "num_tokens" => self.num_tokens,
            "allocated_slots" => self.allocated_slots,
            "used_slots" => self.used_slots,
            "fragmentation" => self.fragmentation,
            "prefix_cache_queries" => self.prefix_cache_queries,
            "prefix_cache_hits" => self.prefix_cache_hits,
            "prefix_cache_query_tokens" => self.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens" => self.prefix_cache_hit_tokens,
            "prefix_cache_hit_rate" => self.prefix_cache_hit_rate(),
            "evictions" => self.evictions,
            "pending_copies" => self.pending_copies,
            "bytes_per_block" => self.bytes_per_block,
            "bytes_total" => self.bytes_total(),
            "host_blocks" => self.host_blocks,
            "host_blocks_used" => self.host_blocks_used,
            "num_swapped" => self.num_swapped,
            "host_blocks_cached" => self.host_blocks_cached,
            "prefix_cache_host_hit_tokens" => self.prefix_cache_host_hit_tokens,
            "prefix_cache_partial_hit_tokens" => self.prefix_cache_partial_hit_tokens,
            "prefix_cache_disk_hit_tokens" => self.prefix_cache_disk_hit_tokens,
            "prefix_cache_store_hit_tokens" => self.prefix_cache_store_hit_tokens,
            "host_prefix_demoted" => self.host_prefix.demoted,
            "host_prefix_demotions_skipped" => self.host_prefix.demotions_skipped,
            "host_prefix_demotions_dropped" => self.host_prefix.demotions_dropped,
            "host_prefix_promoted" => self.host_prefix.promoted,
            "prefix_cache_misses_block_alignment" => self.prefix_cache_misses[0],
            "prefix_cache_misses_not_cached" => self.prefix_cache_misses[1],
            "prefix_cache_misses_evicted" => self.prefix_cache_misses[2],
            "prefix_cache_misses_window" => self.prefix_cache_misses[3],
            "prefix_cache_misses_state_checkpoint" => self.prefix_cache_misses[5],
            "state_checkpoints_saved" => self.state_checkpoints_saved,
            "state_checkpoints_failed" => self.state_checkpoints_failed,
            "num_groups" => self.num_groups,
        ]
    }
}

/// What prefix lookups of token ids asked for and got, in tokens, and why admissions' hits
/// fell short (the block pool counts the same lookups in blocks).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PrefixStats {
    query_tokens: u64,
    hit_tokens: u64,
    /// Of `hit_tokens`, those whose blocks came from the host tier in some group.
    host_hit_tokens: u64,
    /// Of `hit_tokens`, those copied from a partly shared block.
    partial_hit_tokens: u64,
    /// Of `hit_tokens`, those loaded from the disk and from a store; and the blocks, which
    /// the block pool's lookups counted as misses.
    lower_hit_tokens: [u64; 2],
    lower_hit_blocks: u64,
    /// Admissions whose prefix hit fell short, by [`MissReason`].
    misses: [u64; 6],
    checkpoints_saved: u64,
    checkpoints_failed: u64,
}

impl PrefixStats {
    pub(super) fn count_lookup(&mut self, queries: usize, hits: usize, block_size: usize) {
        self.query_tokens += (queries * block_size) as u64;
        self.hit_tokens += (hits * block_size) as u64;
    }

    /// A lookup at sub-block granularity: `queryable` tokens past its whole blocks, `hit` of
    /// them served.
    pub(super) fn count_partial(&mut self, queryable: usize, hit: usize) {
        self.query_tokens += queryable as u64;
        self.hit_tokens += hit as u64;
        self.partial_hit_tokens += hit as u64;
    }

    pub(super) fn count_host_hit(&mut self, blocks: usize, block_size: usize) {
        self.host_hit_tokens += (blocks * block_size) as u64;
    }

    pub(super) fn count_miss(&mut self, reason: MissReason) {
        self.misses[reason as usize] += 1;
    }

    /// `blocks` whole blocks a tier below the host served after the lookup: hits, and, where
    /// they `filled` the admission's every hittable block, its miss is none.
    fn count_lower_hit(
        &mut self,
        disk: bool,
        blocks: usize,
        block_size: usize,
        filled: Option<MissReason>,
    ) {
        let tokens = (blocks * block_size) as u64;
        self.hit_tokens += tokens;
        self.lower_hit_tokens[usize::from(!disk)] += tokens;
        self.lower_hit_blocks += blocks as u64;
        if let Some(reason) = filled {
            let missed = &mut self.misses[reason as usize];
            *missed = missed.saturating_sub(1);
        }
    }

    pub(super) fn count_checkpoint(&mut self) {
        self.checkpoints_saved += 1;
    }

    /// Saves whose copies failed: they were never kept.
    pub(super) fn count_checkpoints_lost(&mut self, saves: usize) {
        let saves = saves as u64;
        debug_assert!(saves <= self.checkpoints_saved);
        self.checkpoints_saved = self.checkpoints_saved.saturating_sub(saves);
        self.checkpoints_failed += saves;
    }
}

impl KvCache {
    /// A tier below the host (`Medium::Disk` or `Medium::Store`) served `blocks` whole blocks
    /// of an admission's prefix: its load landed. They count as hits, with their tier, in
    /// `stats` (the admission's lookup counted them missed); `filled`: the admission's miss
    /// reason, where the load served every block the prompt can hit, which is then no miss.
    pub fn record_tier_hits(
        &mut self,
        medium: Medium,
        blocks: usize,
        filled: Option<MissReason>,
    ) -> CoreResult<()> {
        ensure!(
            matches!(medium, Medium::Disk | Medium::Store),
            "tier hits come from the disk or a store, not the {}",
            medium.name()
        );
        ensure!(
            filled.is_none_or(|reason| MissReason::COUNTED.contains(&reason)),
            "an admission is never counted missed for {:?}",
            filled.map(MissReason::name)
        );
        let block_size = self.block_size();
        self.prefix_stats
            .count_lower_hit(medium == Medium::Disk, blocks, block_size, filled);
        Ok(())
    }

    pub fn stats(&self) -> KvCacheStats {
        let block_size = self.block_size();
        let pool = &self.tiers.block_pool;
        let blocks_used = self.num_blocks() - 1 - pool.num_free();
        let allocated_slots = blocks_used * block_size;
        // A partly filled block shared by forks counts once: sort the (block, fill) pairs.
        let mut partial: Vec<(u32, usize)> = self
            .sequences
            .live()
            .map(|(_, seq)| seq)
            .filter(|seq| !seq.is_swapped() && seq.num_tokens() % block_size != 0)
            .flat_map(|seq| {
                let fill = seq.num_tokens() % block_size;
                seq.tables()
                    .iter()
                    .map(move |table| (*table.blocks().last().unwrap_or(&NULL_BLOCK), fill))
            })
            .filter(|&(block, _)| block != NULL_BLOCK)
            .collect();
        partial.sort_unstable();
        partial.dedup();
        let unused_slots: usize = partial.iter().map(|&(_, fill)| block_size - fill).sum();
        let used_slots = allocated_slots - unused_slots;
        let PrefixCacheCounters {
            queries,
            hits,
            evictions,
        } = pool.counters();
        KvCacheStats {
            num_blocks: self.num_blocks(),
            block_size,
            blocks_used,
            blocks_free: pool.num_free() - pool.num_evictable(),
            blocks_cached: pool.num_evictable(),
            num_sequences: self.sequences.len(),
            num_tokens: self.sequences.live().map(|(_, seq)| seq.num_tokens()).sum(),
            allocated_slots,
            used_slots,
            fragmentation: if allocated_slots == 0 {
                0.0
            } else {
                unused_slots as f64 / allocated_slots as f64
            },
            prefix_cache_queries: queries,
            prefix_cache_hits: hits + self.prefix_stats.lower_hit_blocks,
            prefix_cache_query_tokens: self.prefix_stats.query_tokens,
            prefix_cache_hit_tokens: self.prefix_stats.hit_tokens,
            evictions,
            pending_copies: self.tiers.pending_moves.len(),
            bytes_per_block: self.bytes_per_block,
            host_blocks: self.num_host_blocks(),
            host_blocks_used: self.num_host_blocks() - self.num_free_host_blocks(),
            num_swapped: self
                .sequences
                .live()
                .filter(|(_, seq)| seq.is_swapped())
                .count(),
            host_blocks_cached: self.num_host_cached_blocks(),
            prefix_cache_host_hit_tokens: self.prefix_stats.host_hit_tokens,
            prefix_cache_partial_hit_tokens: self.prefix_stats.partial_hit_tokens,
            prefix_cache_disk_hit_tokens: self.prefix_stats.lower_hit_tokens[0],
            prefix_cache_store_hit_tokens: self.prefix_stats.lower_hit_tokens[1],
            host_prefix: self.host_prefix_counters(),
            prefix_cache_misses: self.prefix_stats.misses,
            state_checkpoints_saved: self.prefix_stats.checkpoints_saved,
            state_checkpoints_failed: self.prefix_stats.checkpoints_failed,
            num_groups: self.groups.len(),
        }
    }

    /// Host memory held by the bookkeeping: the block pool and event log, plus the sequence
    /// slab and index (excluding the block lists themselves, 4 bytes per block held).
    pub fn heap_bytes(&self) -> (usize, usize) {
        let per_sequence = self.sequences.heap_bytes();
        (
            self.tiers.block_pool.heap_bytes() + self.tiers.events.heap_bytes(),
            per_sequence,
        )
    }
}
