//! Growing sequences: the block budget of an append (copy-on-write included) and the append
//! itself, batched.

use super::sequences::{Sequence, SequenceLog};
use super::{swapped_out, KvCache, Tiers, PAD_SLOT};
use crate::alloc::NULL_BLOCK;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::{BlockMove, MoveKind};

impl KvCache {
    /// How many blocks appending `n` tokens to one sequence would take now.
    pub fn blocks_to_append(&mut self, seq_id: u64, n: usize) -> CoreResult<usize> {
        let slab = self.slab_of(seq_id)?;
        self.append_need(&[slab], n)
    }

    /// Checks that appending `n` tokens to each sequence in `slabs` (all distinct) fits, and
    /// fails with `OutOfBlocks` otherwise.
    pub(super) fn check_append_budget(&mut self, slabs: &[u32], n: usize) -> CoreResult<()> {
        let needed = self.append_need(slabs, n)?;
        let available = self.tiers.block_pool.num_free();
        if needed > available {
            return Err(CoreError::OutOfBlocks { needed, available });
        }
        Ok(())
    }

    /// Blocks that appending `n` tokens to each sequence in `slabs` (all distinct) takes: the
    /// blocks the sequences grow by (in every group), plus the copy-on-write replacements of
    /// shared, partly filled last blocks. When every holder of such a block appends in this batch, the last
    /// one to do so keeps the block, so a block held by k sequences costs k - 1 copies, not k.
    fn append_need(&mut self, slabs: &[u32], n: usize) -> CoreResult<usize> {
        let block_size = self.block_size();
        let mut needed = 0;
        self.scratch.blocks.clear();
        for &slab in slabs {
            let seq = &self.sequences[slab];
            if seq.is_swapped() {
                return Err(swapped_out(seq.seq_id()));
            }
            let total = seq.num_tokens() + n;
            ensure!(
                total <= self.max_seq_tokens(),
                "sequence {} would hold {total} tokens; the pool holds at most {} per sequence",
                seq.seq_id(),
                self.max_seq_tokens()
            );
            let new_blocks = total.div_ceil(block_size) - seq.num_blocks();
            if new_blocks > 0 {
                // A group still taking a prompt's blocks as it is computed takes these later.
                let growing = seq.tables().iter().filter(|table| table.complete()).count();
                needed += new_blocks * growing;
            }
            // Only a fork shares a partly filled block (prefix hits share full ones).
            if self.sequences.has_forked() && !seq.num_tokens().is_multiple_of(block_size) {
                for table in seq.tables().iter().filter(|table| table.complete()) {
                    let last = table.blocks().last().copied().unwrap_or(NULL_BLOCK);
                    if last != NULL_BLOCK && self.tiers.block_pool.ref_count(last) > 1 {
                        self.scratch.blocks.push(last);
                    }
                }
            }
        }
        self.scratch.blocks.sort_unstable();
        for holders in self.scratch.blocks.chunk_by(|a, b| a == b) {
            let every_holder_appends =
                holders.len() == self.tiers.block_pool.ref_count(holders[0]) as usize;
            needed += holders.len() - usize::from(every_holder_appends);
        }
        Ok(needed)
    }

    /// Appends `n` tokens to every sequence of the batch and writes their slots, sequence by
    /// sequence, into `slots` (which it clears first); with several groups, group by group
    /// (`[groups, batch × n]`). `token_ids`, when given, holds `n` ids
    /// per sequence in the same order and lets filled blocks join the prefix cache.
    /// All-or-nothing.
    pub fn append_tokens(
        &mut self,
        seq_ids: &[u64],
        n: usize,
        token_ids: Option<&[u32]>,
        slots: &mut Vec<i32>,
    ) -> CoreResult<()> {
        ensure!(n != 0, "n must be at least 1, got 0");
        let total = seq_ids
            .len()
            .checked_mul(n)
            .ok_or_else(|| invalid!("batch × n overflows"))?;
        if let Some(ids) = token_ids {
            ensure!(
                ids.len() == total,
                "token_ids holds {} ids; {} sequences × n={n} need {total}",
                ids.len(),
                seq_ids.len()
            );
        }
        self.resolve_batch(seq_ids)?;
        let slabs = std::mem::take(&mut self.scratch.slabs);
        let result = self.append_resolved(&slabs, n, token_ids, slots);
        self.scratch.slabs = slabs;
        result
    }

    fn append_resolved(
        &mut self,
        slabs: &[u32],
        n: usize,
        token_ids: Option<&[u32]>,
        slots: &mut Vec<i32>,
    ) -> CoreResult<()> {
        self.check_append_budget(slabs, n)?;
        let per_group = slabs.len() * n;
        slots.clear();
        slots.resize(per_group * self.groups.len(), 0);
        for (i, &slab) in slabs.iter().enumerate() {
            let ids = token_ids.map(|ids| &ids[i * n..(i + 1) * n]);
            self.append_to(slab, n, ids, |group, t, slot| {
                slots[group * per_group + i * n + t] = slot;
            })?;
        }
        Ok(())
    }

    /// Appends `n` tokens to one sequence whose budget was checked; `emit(group, t, slot)`
    /// receives the slot of the t-th new token in each group.
    #[inline]
    pub(super) fn append_to(
        &mut self,
        slab: u32,
        n: usize,
        token_ids: Option<&[u32]>,
        mut emit: impl FnMut(usize, usize, i32),
    ) -> CoreResult<()> {
        let version = self.sequences.new_version();
        let block_size = self.block_size();
        let KvCache {
            sequences, tiers, ..
        } = self;
        let has_forked = sequences.has_forked();
        let (seq, log) = sequences.with_log(slab);
        if has_forked && seq.num_tokens() % block_size != 0 {
            copy_shared_tails((seq, log, slab), tiers, version)?;
        }
        if token_ids.is_none() && seq.is_hashable() {
            seq.stop_naming(log, slab);
        }
        let keep_token_ids = seq.is_hashable()
            && (tiers.events.enabled() || tiers.block_pool.sub_blocks_per_block() > 0);
        for t in 0..n {
            let position = seq.num_tokens() + t;
            let (index, offset) = (position / block_size, position % block_size);
            for (group, table) in seq.tables_mut().iter_mut().enumerate() {
                if !table.complete() {
                    // Its blocks come as the tokens are computed; no slot yet.
                    if offset == 0 {
                        table.push_pending();
                    }
                    emit(group, t, PAD_SLOT);
                    continue;
                }
                if offset == 0 {
                    table.push(tiers.allocate_device()?);
                }
                let block = table.blocks()[index];
                emit(group, t, (block as usize * block_size + offset) as i32);
            }
            if let (Some(ids), true) = (token_ids, seq.is_hashable()) {
                seq.push_token_id(ids[t], keep_token_ids, block_size);
            }
        }
        seq.grew(n, version);
        Ok(())
    }
}

/// Copy-on-write before an append: each group's last block, when it is partly filled and
/// shared (only after a fork), is replaced by a copy of its own, stamped `version`.
fn copy_shared_tails(
    (seq, log, slab): (&mut Sequence, &mut SequenceLog, u32),
    tiers: &mut Tiers,
    version: u64,
) -> CoreResult<()> {
    for (group, table) in seq.tables_mut().iter_mut().enumerate() {
        if !table.complete() || table.released() == table.allocated() {
            continue;
        }
        let index = table.allocated() - 1;
        let last = table.blocks()[index];
        if tiers.block_pool.ref_count(last) > 1 {
            let copy = tiers.allocate_device()?;
            tiers
                .pending_moves
                .push(BlockMove::new(MoveKind::Copy, last, copy));
            tiers.block_pool.release(last);
            table.set(index, copy, log, (slab, group as u32));
            table.stamp_layout(version);
        }
    }
    Ok(())
}
