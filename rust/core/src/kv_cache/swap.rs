//! The host tier: swapping sequences out to host blocks and back in. (Its prefix cache, the
//! blocks the device evicts, is `host_prefix`.)

use super::host_prefix::{allocate_device, HostPrefixCounters};
use super::{allocate_checked, swapped_out, KvCache, KvEventLog, NO_BLOCK};
use crate::alloc::{BlockPool, NULL_BLOCK};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::{BlockMove, MoveKind};

/// Host blocks for swapped-out sequences (block 0 unused here too) and, with a host prefix
/// cache, for the cached blocks the device evicted; and the scratch a swap plans its moves in.
#[derive(Debug, Clone)]
pub(super) struct HostTier {
    pub(super) pool: BlockPool,
    /// Source block → destination block while a swap is planned; `NO_BLOCK` elsewhere. As
    /// long as the larger tier, so either tier's blocks index it.
    pub(super) scratch_moves: Vec<u32>,
    pub(super) prefix_counters: HostPrefixCounters,
}

impl HostTier {
    fn new(
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
    pub(super) fn check_invariants(&self, holders: &[u32]) -> Result<(), String> {
        self.pool
            .check_invariants(holders)
            .map_err(|error| format!("host tier: {error}"))?;
        match self.scratch_moves.iter().all(|&moved| moved == NO_BLOCK) {
            true => Ok(()),
            false => Err("swap scratch left dirty".into()),
        }
    }
}

impl KvCache {
    /// Adds a host tier of `num_host_blocks` blocks that `swap_out` moves sequences to.
    pub fn enable_host_tier(&mut self, num_host_blocks: usize) -> CoreResult<()> {
        ensure!(
            self.host_tier.is_none() && self.sequences.is_empty(),
            "the host tier is set once, before any sequence exists",
        );
        ensure!(
            num_host_blocks != 0,
            "num_host_blocks must be at least 1, got 0",
        );
        let tier = HostTier::new(num_host_blocks, self.num_blocks(), self.block_size(), false)?;
        self.events.resize_host_tier(num_host_blocks + 1)?;
        self.host_tier = Some(tier);
        Ok(())
    }

    /// Keeps the cached blocks the device evicts in the host tier, where a later prefix
    /// lookup finds them (see `host_prefix`). Set once, after `enable_host_tier` and before
    /// any sequence exists; needs prefix caching.
    pub fn enable_host_prefix_cache(&mut self) -> CoreResult<()> {
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
        self.host_tier = Some(HostTier::new(
            num_host_blocks,
            self.num_blocks(),
            self.block_size(),
            true,
        )?);
        self.record_host_prefix_events()
    }

    /// Usable host blocks (0 without a host tier).
    pub fn num_host_blocks(&self) -> usize {
        self.host_tier
            .as_ref()
            .map_or(0, |tier| tier.pool.num_blocks() - 1)
    }

    pub fn num_free_host_blocks(&self) -> usize {
        self.host_tier
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
            self.host_tier.is_some(),
            "this KV cache has no host tier: construct it with num_host_blocks",
        );
        self.resolve_batch(seq_ids)?;
        let slabs = std::mem::take(&mut self.scratch_slabs);
        let result = self
            .check_swap(&slabs, direction)
            .and_then(|()| self.swap_resolved(&slabs, direction));
        self.scratch_slabs = slabs;
        result
    }

    /// Checks that every sequence of `slabs` can move in `direction` and that the
    /// destination tier has a block for each distinct source block. Changes nothing.
    fn check_swap(&mut self, slabs: &[u32], direction: MoveKind) -> CoreResult<()> {
        let out = direction.writes_host();
        for &slab in slabs {
            let seq = &self.sequences[slab];
            if seq.swapped == out {
                return Err(match out {
                    true => swapped_out(seq.seq_id),
                    false => invalid!("sequence {} is not swapped out", seq.seq_id),
                });
            }
        }
        let Some(tier) = self.host_tier.as_mut() else {
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
            false => self.block_pool.num_free(),
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
            sequences,
            block_pool,
            host_tier,
            pending_moves,
            events,
            ..
        } = self;
        let Some(tier) = host_tier.as_mut() else {
            return Ok(());
        };
        let first_move = pending_moves.len();
        for &slab in slabs {
            // New block tables: a new version (rows that show it are rewritten).
            let version = sequences.new_version();
            let (seq, log) = sequences.with_log(slab);
            seq.version = version;
            let mut moving = MovingTiers {
                direction,
                tier: &mut *tier,
                block_pool: &mut *block_pool,
                moves: &mut *pending_moves,
                events: &mut *events,
            };
            for (group, table) in seq.tables.iter_mut().enumerate() {
                for index in (table.released..table.allocated).rev() {
                    let moved = moving.move_block(table.blocks[index])?;
                    table.set(index, moved, log, (slab, group as u32));
                }
                table.layout = seq.version;
            }
            for index in 0..seq.state.len() {
                let moved = moving.move_block(seq.state[index])?;
                seq.set_state(index, moved, log, slab);
            }
            // Blocks whose contents the prefix cache names: their host copies are events.
            let named = seq.num_registered.min(seq.hashes.len());
            if out && events.enabled() {
                // Host copies this evicted leave first: a block holds one name at a time.
                tier.pool
                    .drain_removed(|_, block| events.host_block_freed(block));
                for group in 0..seq.tables.len() {
                    for index in 0..named {
                        let block = seq.tables[group].blocks[index];
                        if block == NULL_BLOCK {
                            continue; // released by a window
                        }
                        let (parent, hash, tokens) = seq.named_block(index, block_size);
                        let root = seq.root_hash;
                        events.host_copy_made(block, group as u32, parent, root, hash, tokens);
                    }
                }
            }
            seq.swapped = out;
            // Fresh device blocks: offered to the prefix cache again once computed.
            seq.num_registered = 0;
        }
        for planned in &pending_moves[first_move..] {
            tier.scratch_moves[planned.src as usize] = NO_BLOCK;
        }
        self.sync_removed();
        Ok(())
    }
}

/// The tiers a swap moves blocks between, in `direction`.
struct MovingTiers<'a> {
    direction: MoveKind,
    tier: &'a mut HostTier,
    block_pool: &'a mut BlockPool,
    moves: &'a mut Vec<BlockMove>,
    events: &'a mut KvEventLog,
}

impl MovingTiers<'_> {
    /// Moves one held block (once, however many sequences share it: `scratch_moves` knows
    /// where it went) and releases it; where it went.
    fn move_block(&mut self, block: u32) -> CoreResult<u32> {
        let (out, tier) = (self.direction.writes_host(), &mut *self.tier);
        let moved = match tier.scratch_moves[block as usize] {
            NO_BLOCK => {
                let (moved, kind) = match out {
                    true => (allocate_checked(&mut tier.pool)?, MoveKind::ToHost),
                    // A device block this evicts may be demoted to the host tier, after the
                    // moves that read the host blocks released so far.
                    false => {
                        let moved =
                            allocate_device(self.block_pool, Some(tier), self.moves, self.events)?;
                        (moved, MoveKind::ToDevice)
                    }
                };
                tier.scratch_moves[block as usize] = moved;
                self.moves.push(BlockMove::new(kind, block, moved));
                moved
            }
            moved => {
                match out {
                    true => tier.pool.share(moved),
                    false => self.block_pool.share(moved),
                }
                moved
            }
        };
        let source = match out {
            true => &mut *self.block_pool,
            false => &mut tier.pool,
        };
        source.release(block);
        if !out && self.events.enabled() && source.ref_count(block) == 0 {
            self.events.host_block_freed(block);
        }
        Ok(moved)
    }
}
