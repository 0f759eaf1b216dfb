//! Windowed groups (sliding-window, chunked-local) move with the computed frontier: behind it
//! they release what no later token reads, ahead of it they take the blocks of the tokens
//! being computed (a prompt admitted with `admit_sequence` gets them chunk by chunk).

use super::{allocate_checked, AttentionKind, KvCache};
use crate::alloc::NULL_BLOCK;
use crate::error::CoreResult;

impl KvCache {
    /// Blocks `mark_computed(seq_id, Some(num_tokens))` would take now: the windowed groups'
    /// blocks for newly marked tokens that a prompt admitted with `admit_sequence` lacks
    /// (blocks it releases are not counted: they may be shared).
    pub fn blocks_to_compute(&self, seq_id: u64, num_tokens: usize) -> CoreResult<usize> {
        let slab = self.slab_of(seq_id)?;
        let seq = self.device_sequence(seq_id)?;
        ensure!(
            num_tokens <= seq.num_tokens,
            "sequence {seq_id} holds {} tokens; {num_tokens} cannot be computed",
            seq.num_tokens
        );
        Ok(self.window_need(slab, num_tokens))
    }

    /// See [`KvCache::blocks_to_compute`]; `num_tokens` is within the sequence.
    pub(super) fn window_need(&self, slab: u32, num_tokens: usize) -> usize {
        let block_size = self.block_size();
        let seq = &self.sequences[slab as usize];
        let end = num_tokens.div_ceil(block_size);
        let mut needed = 0;
        let mut first_needed = FirstNeeded::default();
        for (table, spec) in seq.tables.iter().zip(&self.groups) {
            if spec.kind.span().is_some() {
                let from = first_needed.of(spec.kind, seq.num_computed, block_size);
                needed += end.saturating_sub(table.allocated.max(from));
            }
        }
        needed
    }

    /// Releases, in each windowed group, the blocks before the window of the first token
    /// still to compute, then allocates the group's missing blocks up to `num_tokens`. The
    /// budget was checked (`window_need`).
    pub(super) fn advance_windows(&mut self, slab: u32, num_tokens: usize) -> CoreResult<()> {
        let block_size = self.block_size();
        let version = self.bump_version();
        let KvCache {
            sequences,
            block_pool,
            groups,
            ..
        } = self;
        let seq = &mut sequences[slab as usize];
        let end = num_tokens.div_ceil(block_size);
        let mut first_needed = FirstNeeded::default();
        for (table, spec) in seq.tables.iter_mut().zip(groups.iter()) {
            if spec.kind.span().is_none() {
                continue;
            }
            let from = first_needed
                .of(spec.kind, seq.num_computed, block_size)
                .min(table.blocks.len());
            // A release only turns leading cells null (tables follow `released`); filling a
            // prompt's pending cells replaces entries, which the layout stamp says.
            let released = table.released < from;
            let filled = table.allocated < end;
            if released {
                // Head first: the oldest of them is evicted first if it stays cached.
                let held = from.min(table.allocated).max(table.released);
                for block in &mut table.blocks[table.released..held] {
                    block_pool.release(*block);
                    *block = NULL_BLOCK;
                }
                table.released = from;
                table.allocated = table.allocated.max(from);
            }
            while table.allocated < end {
                table.blocks[table.allocated] = allocate_checked(block_pool)?;
                table.allocated += 1;
            }
            if filled {
                table.layout = version;
            }
            if released || filled {
                seq.version = version;
            }
        }
        Ok(())
    }
}

/// The first block a windowed kind still reads, computed once per kind (a model's windowed
/// groups are mostly of one kind: Gemma 3's six sliding groups share one window).
#[derive(Default)]
struct FirstNeeded(Option<(AttentionKind, usize)>);

impl FirstNeeded {
    #[inline]
    fn of(&mut self, kind: AttentionKind, position: usize, block_size: usize) -> usize {
        match self.0 {
            Some((known, block)) if known == kind => block,
            _ => {
                let block = kind.first_needed_block(position, block_size);
                self.0 = Some((kind, block));
                block
            }
        }
    }
}
