//! Recurrent layers' state: one fixed-size state per sequence and layer, in pool blocks.
//!
//! A Mamba or gated delta-net layer (transformers' `"linear_attention"`) keeps no K/V per
//! token: each sequence carries a conv state and an SSM (delta-rule) state of a fixed size,
//! rewritten by every step. Those states live in blocks of the same pool as the attention
//! groups' K/V (ATB's one-pool strategy), so a long attention context and many states draw on
//! one budget. Recurrent layers are grouped like attention layers (`group_hybrid_layers`): a
//! state group's layer in slot `s` keeps its state in slot `s` of the group's blocks, and a
//! state that is larger than one slot of one block takes `num_blocks` blocks, its bytes laid
//! out over `[K, V] × blocks` of that slot in order.
//!
//! A sequence takes its state blocks at admission and gives them back at its end. Nothing
//! about a state is shared: a fork copies the parent's state into the child's own blocks (a
//! copy move, run before the next kernels), and a swap moves it with the sequence. A state
//! exists only for the position it was computed at, so a prefix hit would need a state kept at
//! the hit's position; until such checkpoints exist, a cache with state groups serves no
//! prefix hit and caches no block (`explain_prefix` says `state_checkpoint`).

use super::KvCache;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::{BlockMove, MoveKind};

/// Recurrent layers whose states share blocks: the layer `layers[s]` keeps its state in slot
/// `s` of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateGroup {
    pub layers: Vec<usize>,
    /// Bytes of one layer's state.
    pub state_bytes: usize,
    /// Blocks one sequence's state takes in this group.
    pub num_blocks: usize,
    /// Where the group's blocks start in a sequence's state blocks (its state-table row).
    pub first_column: usize,
}

/// The recurrent layers' states: their groups, the blocks each sequence holds for them, and
/// how often a sequence keeps a checkpoint of them (see `state_checkpoints`).
#[derive(Debug, Clone)]
pub(super) struct RecurrentStates {
    pub(super) groups: Vec<StateGroup>,
    pub(super) blocks_per_seq: usize,
    /// Blocks between two checkpoints of a sequence's states.
    pub(super) checkpoint_interval: usize,
}

/// The state groups of `recurrent` (state bytes, layers), with blocks whose every slot holds
/// `slot_bytes`: each state takes as many blocks as its bytes need.
pub(super) fn state_groups(
    recurrent: Vec<(usize, Vec<usize>)>,
    slot_bytes: usize,
) -> Vec<StateGroup> {
    let mut first_column = 0;
    recurrent
        .into_iter()
        .map(|(state_bytes, layers)| {
            let num_blocks = state_bytes.div_ceil(slot_bytes);
            let group = StateGroup {
                layers,
                state_bytes,
                num_blocks,
                first_column,
            };
            first_column += num_blocks;
            group
        })
        .collect()
}

impl KvCache {
    /// The recurrent layers' groups (none for a model of attention layers only).
    pub fn state_groups(&self) -> &[StateGroup] {
        &self.states.groups
    }

    /// Blocks every sequence holds for its recurrent layers' states, whatever its length.
    #[inline]
    pub fn num_state_blocks(&self) -> usize {
        self.states.blocks_per_seq
    }

    #[inline]
    pub(super) fn has_state(&self) -> bool {
        self.states.blocks_per_seq > 0
    }

    /// The state group of recurrent layer `layer` and the slot it uses in that group's blocks.
    pub fn state_of_layer(&self, layer: usize) -> CoreResult<(usize, usize)> {
        let found = self
            .states
            .groups
            .iter()
            .enumerate()
            .find_map(|(group, spec)| {
                let slot = spec.layers.iter().position(|&l| l == layer)?;
                Some((group, slot))
            });
        match found {
            Some(found) => Ok(found),
            None if layer < self.layout.num_layers => Err(invalid!(
                "layer {layer} is an attention layer: it has K/V blocks, not a state \
                 (group_of_layer)"
            )),
            None => Err(invalid!(
                "layer {layer} is not a layer of this model (num_layers = {})",
                self.layout.num_layers
            )),
        }
    }

    /// A sequence's state blocks: `num_state_blocks` of them, state group by group (host
    /// blocks while it is swapped out).
    pub fn state_blocks(&self, seq_id: u64) -> CoreResult<&[u32]> {
        Ok(self.sequence(seq_id)?.state())
    }

    /// The state blocks of `seq_ids` (on the device), row by row, into `out` (`len(seq_ids)
    /// × num_state_blocks` entries). Checks every id before it writes.
    pub fn state_table(&self, seq_ids: &[u64], out: &mut [i32]) -> CoreResult<()> {
        let width = self.states.blocks_per_seq;
        ensure!(
            out.len() == seq_ids.len() * width,
            "a state table of {} sequences has {} entries, got {}",
            seq_ids.len(),
            seq_ids.len() * width,
            out.len()
        );
        for &seq_id in seq_ids {
            self.device_sequence(seq_id)?;
        }
        for (row, &seq_id) in out.chunks_exact_mut(width.max(1)).zip(seq_ids) {
            let state = self.device_sequence(seq_id)?.state();
            for (cell, &block) in row.iter_mut().zip(state) {
                *cell = block as i32;
            }
        }
        Ok(())
    }

    /// Gives the new sequence in `slab` its state blocks. The caller checked the budget.
    pub(super) fn take_state_blocks(&mut self, slab: u32) -> CoreResult<()> {
        let KvCache {
            sequences,
            tiers,
            states,
            ..
        } = self;
        let seq = &mut sequences[slab];
        debug_assert!(seq.state().is_empty());
        for _ in 0..states.blocks_per_seq {
            seq.add_state_block(tiers.allocate_device()?);
        }
        Ok(())
    }

    /// Fails unless the free queue holds a state's blocks (what a fork takes).
    pub(super) fn check_state_budget(&self) -> CoreResult<()> {
        let (needed, available) = (self.states.blocks_per_seq, self.tiers.block_pool.num_free());
        match needed <= available {
            true => Ok(()),
            false => Err(CoreError::OutOfBlocks { needed, available }),
        }
    }

    /// Gives the child in `child_slab` state blocks of its own, and plans the copy of the
    /// parent's state into them. The caller checked the budget.
    pub(super) fn copy_state(&mut self, parent_slab: u32, child_slab: u32) -> CoreResult<()> {
        if !self.has_state() {
            return Ok(());
        }
        self.take_state_blocks(child_slab)?;
        let (parent, child) = self.sequences.two_mut(parent_slab, child_slab);
        for (&src, &dst) in parent.state().iter().zip(child.state()) {
            self.tiers
                .pending_moves
                .push(BlockMove::new(MoveKind::Copy, src, dst));
        }
        self.sync_removed();
        Ok(())
    }
}
