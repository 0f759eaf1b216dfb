//! The window policy: what a group of each attention kind holds, in one place.
//!
//! A full-attention group keeps every block a sequence ever had. Windowed groups
//! (sliding-window, chunked-local) move with the computed frontier: behind it they release
//! what no later token reads, ahead of it they take the blocks of the tokens being computed
//! (a prompt admitted with `admit_sequence` gets them chunk by chunk). The rest of the cache
//! asks the questions below rather than matching on the kind.

use super::{AttentionKind, KvCache};
use crate::alloc::NULL_BLOCK;
use crate::error::CoreResult;

impl AttentionKind {
    /// Whether the group releases blocks behind the computed frontier. Such a group takes a
    /// prompt's blocks as they are computed when the scheduler admits it, a prefix hit needs
    /// only the blocks its window reads, and a miss there means the window's blocks are gone.
    #[inline]
    pub fn is_windowed(self) -> bool {
        !matches!(self, AttentionKind::Full)
    }

    /// Most blocks one sequence holds at once in a group of this kind: the window (or chunk)
    /// and one block more, as a window straddles a block boundary; `None` for every block.
    #[inline]
    pub fn max_blocks_held(self, block_size: usize) -> Option<usize> {
        self.span().map(|span| span.div_ceil(block_size) + 1)
    }

    /// Whether the prefix cache remembers this group's evictions, to name a miss `Evicted`: a
    /// windowed group releases blocks as its window moves, so its misses are `WindowGone`.
    #[inline]
    pub fn remembers_evictions(self) -> bool {
        !self.is_windowed()
    }
}

impl KvCache {
    /// Blocks `mark_computed(seq_id, Some(num_tokens))` would take now: the windowed groups'
    /// blocks for newly marked tokens that a prompt admitted with `admit_sequence` lacks
    /// (blocks it releases are not counted: they may be shared).
    pub fn blocks_to_compute(&self, seq_id: u64, num_tokens: usize) -> CoreResult<usize> {
        let slab = self.slab_of(seq_id)?;
        let seq = self.device_sequence(seq_id)?;
        ensure!(
            num_tokens <= seq.num_tokens(),
            "sequence {seq_id} holds {} tokens; {num_tokens} cannot be computed",
            seq.num_tokens()
        );
        Ok(self.window_need(slab, num_tokens))
    }

    /// See [`KvCache::blocks_to_compute`]; `num_tokens` is within the sequence.
    pub(super) fn window_need(&self, slab: u32, num_tokens: usize) -> usize {
        let block_size = self.block_size();
        let seq = &self.sequences[slab];
        if seq.window_bounds().settled(seq.num_computed()) {
            return 0;
        }
        let end = num_tokens.div_ceil(block_size);
        let mut needed = 0;
        let mut first_needed = FirstNeeded::default();
        for (table, spec) in seq.tables().iter().zip(&self.groups) {
            if spec.kind.is_windowed() {
                let from = first_needed.of(spec.kind, seq.num_computed(), block_size);
                needed += end.saturating_sub(table.allocated().max(from));
            }
        }
        needed
    }

    /// Releases, in each windowed group, the blocks before the window of the first token
    /// still to compute, then allocates the group's missing blocks up to `num_tokens`. The
    /// budget was checked (`window_need`).
    pub(super) fn advance_windows(&mut self, slab: u32, num_tokens: usize) -> CoreResult<()> {
        let block_size = self.block_size();
        let seq = &self.sequences[slab];
        if seq.window_bounds().settled(seq.num_computed()) {
            debug_assert!(
                self.windows_stay(slab, num_tokens),
                "window bounds skipped a release or an allocation"
            );
            return Ok(()); // most decode steps
        }
        let version = self.sequences.new_version();
        let KvCache {
            sequences,
            tiers,
            groups,
            ..
        } = self;
        let (seq, log) = sequences.with_log(slab);
        let end = num_tokens.div_ceil(block_size);
        let mut first_needed = FirstNeeded::default();
        let mut bounds = WindowBounds::SETTLED;
        let (num_computed, mut changed) = (seq.num_computed(), false);
        for (group, (table, spec)) in seq.tables_mut().iter_mut().zip(groups.iter()).enumerate() {
            let at = (slab, group as u32);
            if !spec.kind.is_windowed() {
                continue;
            }
            let from = first_needed
                .of(spec.kind, num_computed, block_size)
                .min(table.blocks().len());
            // A release only turns leading cells null (tables follow `released`); filling a
            // prompt's pending cells replaces entries, which the layout stamp says.
            let released = table.released() < from;
            let filled = table.allocated() < end;
            if released {
                // Head first: the oldest of them is evicted first if it stays cached.
                let held = from.min(table.allocated()).max(table.released());
                for index in table.released()..held {
                    tiers.block_pool.release(table.blocks()[index]);
                    table.set(index, NULL_BLOCK, log, at);
                }
                table.release_before(from);
            }
            while table.allocated() < end {
                table.fill_next(tiers.allocate_device()?, log, at);
            }
            if filled {
                table.stamp_layout(version);
            }
            changed |= released || filled;
            bounds.include(spec.kind, table.released(), table.complete(), block_size);
        }
        if changed {
            seq.stamp(version);
        }
        seq.set_window_bounds(bounds);
        Ok(())
    }

    /// Whether `advance_windows(slab, num_tokens)` would change nothing, worked out in full:
    /// what the bounds' shortcut must agree with (checked in debug builds).
    fn windows_stay(&self, slab: u32, num_tokens: usize) -> bool {
        let block_size = self.block_size();
        let seq = &self.sequences[slab];
        let end = num_tokens.div_ceil(block_size);
        seq.tables()
            .iter()
            .zip(&self.groups)
            .filter(|(_, spec)| spec.kind.is_windowed())
            .all(|(table, spec)| {
                let from = spec.kind.first_needed_block(seq.num_computed(), block_size);
                table.released() >= from.min(table.blocks().len()) && table.allocated() >= end
            })
    }
}

/// Until when a sequence's windowed groups have nothing to release or allocate, so that
/// `mark_computed` skips them (a decode step crosses a block boundary once in `block_size`
/// steps). Valid while no table's `released` decreases and no complete table turns
/// incomplete: appends only add blocks (a complete table's held), and whatever starts a table
/// over (a new sequence, a fork's child) resets the bounds to the default, which settles
/// nothing. One `u32` (a sequence's fixed state is per-sequence memory): beyond `u32::MAX`
/// it only says less.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct WindowBounds {
    /// Computed positions below this leave every windowed group as it is: no held block
    /// falls out of a window, and every group's blocks are allocated (none is still taking a
    /// prompt's blocks as they are computed).
    quiet_below: u32,
}

impl WindowBounds {
    /// No windowed group: nothing ever to do.
    const SETTLED: WindowBounds = WindowBounds {
        quiet_below: u32::MAX,
    };

    /// Whether computing from position `position` on leaves every windowed group as it is.
    #[inline]
    fn settled(self, position: usize) -> bool {
        position < self.quiet_below as usize
    }

    /// Narrows the bounds to those of a group of `kind` that released its first `released`
    /// blocks, all of whose other blocks are allocated if `complete`.
    fn include(&mut self, kind: AttentionKind, released: usize, complete: bool, block_size: usize) {
        // The block after the released ones is left behind once the first attended
        // position reaches the block after it.
        let past = (released + 1) * block_size;
        let quiet_below = match (kind, complete) {
            (_, false) => 0,
            (AttentionKind::Full, true) => usize::MAX,
            (AttentionKind::SlidingWindow { window }, true) => past.saturating_add(window - 1),
            (AttentionKind::ChunkedLocal { chunk }, true) => {
                past.div_ceil(chunk).saturating_mul(chunk)
            }
        };
        let quiet_below = u32::try_from(quiet_below).unwrap_or(u32::MAX);
        self.quiet_below = self.quiet_below.min(quiet_below);
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
