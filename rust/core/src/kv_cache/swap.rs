//! The host tier: swapping sequences out to host blocks and back in. (Its prefix cache, the
//! blocks the device evicts, is `host_prefix`.)

use super::tiers::HostTier;
use super::{swapped_out, KvCache, MoveKind, NO_BLOCK};
use crate::alloc::NULL_BLOCK;
use crate::error::{CoreError, CoreResult};

impl KvCache {
    /// Adds a host tier of `num_host_blocks` blocks that `swap_out` moves sequences to
    /// (`KvCacheConfig::host_blocks`, applied by `from_config`).
    pub(super) fn enable_host_tier(&mut self, num_host_blocks: usize) -> CoreResult<()> {
        ensure!(
            self.tiers.host_tier.is_none() && self.sequences.is_empty(),
            "the host tier is set once, before any sequence exists",
        );
        ensure!(
            num_host_blocks != 0,
            "num_host_blocks must be at least 1, got 0",
        );
        let tier = HostTier::new(num_host_blocks, self.num_blocks(), self.block_size(), false)?;
        self.tiers.events.resize_host_tier(num_host_blocks + 1)?;
        self.tiers.host_tier = Some(tier);
        Ok(())
    }

    /// Keeps the cached blocks the device evicts in the host tier, where a later prefix
    /// lookup finds them (see `host_prefix`): `KvCacheConfig::host_prefix_cache`, applied by
    /// `from_config` after `enable_host_tier` and before any sequence exists; needs prefix
    /// caching.
    pub(super) fn enable_host_prefix_cache(&mut self) -> CoreResult<()> {
        ensure!(
            self.enable_prefix_caching(),
            "a host prefix cache needs prefix caching on the device"
        );
        ensure!(
            self.sequences.is_empty(),
            "the host prefix cache is turned on once, before any sequence exists"
        );
        let num_host_blocks = self.num_host_blocks();
        ensure!(
            num_host_blocks != 0,
            "a host prefix cache needs a host tier: construct the cache with num_host_blocks"
        );
        self.tiers.host_tier = Some(HostTier::new(
            num_host_blocks,
            self.num_blocks(),
            self.block_size(),
            true,
        )?);
        self.record_host_prefix_events()
    }

    /// Usable host blocks (0 without a host tier).
    pub fn num_host_blocks(&self) -> usize {
        self.tiers
            .host_tier
            .as_ref()
            .map_or(0, |tier| tier.pool.num_blocks() - 1)
    }

    pub fn num_free_host_blocks(&self) -> usize {
        self.tiers
            .host_tier
            .as_ref()
            .map_or(0, |tier| tier.pool.num_free())
    }

    /// Moves the sequences' blocks to the host tier and frees their device blocks. The
    /// (device block → host block) moves join the pending moves (see [`KvCache::take_moves`]),
    /// after any pending copy; a block the sequences share is moved once. All-or-nothing.
    pub fn swap_out(&mut self, seq_ids: &[u64]) -> CoreResult<()> {
        self.swap(seq_ids, MoveKind::ToHost)
    }

    /// Brings swapped-out sequences back into free device blocks (evicting cached ones if
    /// need be); the (host block → device block) moves join the pending moves. The blocks
    /// rejoin the prefix cache with the next `mark_computed`, once their bytes are back.
    /// All-or-nothing.
    pub fn swap_in(&mut self, seq_ids: &[u64]) -> CoreResult<()> {
        self.swap(seq_ids, MoveKind::ToDevice)
    }

    /// Swaps the sequences out (`ToHost`) or in (`ToDevice`).
    pub(super) fn swap(&mut self, seq_ids: &[u64], direction: MoveKind) -> CoreResult<()> {
        debug_assert!(direction != MoveKind::Copy, "a swap moves between tiers");
        ensure!(
            self.tiers.host_tier.is_some(),
            "this KV cache has no host tier: construct it with num_host_blocks",
        );
        self.resolve_batch(seq_ids)?;
        let slabs = std::mem::take(&mut self.scratch.slabs);
        let result = self
            .check_swap(&slabs, direction)
            .and_then(|()| self.swap_resolved(&slabs, direction));
        self.scratch.slabs = slabs;
        result
    }

    /// Checks that every sequence of `slabs` can move in `direction` and that the
    /// destination tier has a block for each distinct source block. Changes nothing.
    fn check_swap(&mut self, slabs: &[u32], direction: MoveKind) -> CoreResult<()> {
        let out = direction.writes_host();
        for &slab in slabs {
            let seq = &self.sequences[slab];
            if seq.is_swapped() == out {
                return Err(match out {
                    true => swapped_out(seq.seq_id()),
                    false => invalid!("sequence {} is not swapped out", seq.seq_id()),
                });
            }
        }
        let Some(tier) = self.tiers.host_tier.as_mut() else {
            return Ok(()); // `swap` checked
        };
        // Each distinct source block is copied once: count them with the scratch marks.
        let mut needed = 0;
        for pass in [true, false] {
            for &slab in slabs {
                for block in self.sequences[slab].held_blocks() {
                    let mark = &mut tier.scratch_moves[block as usize];
                    if pass && *mark == NO_BLOCK {
                        needed += 1;
                    }
                    *mark = if pass { 0 } else { NO_BLOCK };
                }
            }
        }
        let available = match out {
            true => self.num_free_host_blocks(),
            false => self.tiers.block_pool.num_free(),
        };
        if needed > available {
            return Err(match out {
                true => CoreError::OutOfHostBlocks { needed, available },
                false => CoreError::OutOfBlocks { needed, available },
            });
        }
        Ok(())
    }

    /// Swaps the sequences of `slabs`, which `check_swap` passed.
    fn swap_resolved(&mut self, slabs: &[u32], direction: MoveKind) -> CoreResult<()> {
        let out = direction.writes_host();
        self.sync_removed();
        let block_size = self.block_size();
        let KvCache {
            sequences, tiers, ..
        } = self;
        if tiers.host_tier.is_none() {
            return Ok(());
        }
        let first_move = tiers.pending_moves.len();
        for &slab in slabs {
            // New block tables: a new version (rows that show it are rewritten).
            let version = sequences.new_version();
            let (seq, log) = sequences.with_log(slab);
            seq.stamp(version);
            for (group, table) in seq.tables_mut().iter_mut().enumerate() {
                for index in (table.released()..table.allocated()).rev() {
                    let moved = tiers.move_block(table.blocks()[index], direction)?;
                    table.set(index, moved, log, (slab, group as u32));
                }
                table.stamp_layout(version);
            }
            for index in 0..seq.state().len() {
                let moved = tiers.move_block(seq.state()[index], direction)?;
                seq.set_state(index, moved, log, slab);
            }
            // Blocks whose contents the prefix cache names: their host copies are events.
            let named = seq.num_registered().min(seq.hashes().len());
            let (host_tier, events) = (&mut tiers.host_tier, &mut tiers.events);
            if let (true, Some(tier)) = (out && events.enabled(), host_tier.as_mut()) {
                // Host copies this evicted leave first: a block holds one name at a time.
                tier.pool
                    .drain_removed(|_, block| events.host_block_freed(block));
                for group in 0..seq.tables().len() {
                    for index in 0..named {
                        let block = seq.tables()[group].blocks()[index];
                        if block == NULL_BLOCK {
                            continue; // released by a window
                        }
                        let (parent, hash, tokens) = seq.named_block(index, block_size);
                        let root = seq.root_hash();
                        events.host_copy_made(block, group as u32, parent, root, hash, tokens);
                    }
                }
            }
            // Fresh device blocks: offered to the prefix cache again once computed.
            seq.moved_tier(out);
        }
        tiers.forget_moved(first_move)?;
        self.sync_removed();
        Ok(())
    }
}
