//! Recurrent layers' states in the scheduler model.
//!
//! A state is simulated as a recurrence over the values of the tokens it has seen: a row that
//! starts at position 0 starts from `STATE_START` (a model never reads a fresh state); any
//! other row reads the state its sequence's state blocks hold, folds its tokens' values in,
//! and writes the result to every one of those blocks. After every operation, a live
//! sequence's state blocks must all hold the fold of its computed tokens, in the tier it
//! lives on: a fork that does not copy the state, a swap that leaves it behind, a recompute
//! that starts from a stale state or a recovery that keeps a damaged one all fail it.

use std::collections::HashMap;

use atb_mem_core::{AttentionKind, KvCacheConfig, KvLayout, LayerKind, SchedulerConfig};

use super::workload::{value, LayerKinds, Op, GARBAGE};
use super::{Counts, Harness};

const STATE_START: u64 = 0xcbf2_9ce4_8422_2325;

/// Recurrent layers added after the attention layers, how many K/V slots of a block one
/// state fills (a state larger than a slot spans several blocks), and the blocks between
/// two checkpoints of a sequence's states.
pub type StateLayers = (usize, usize, usize);

fn fold(state: u64, value: u64) -> u64 {
    (state ^ value).wrapping_mul(0x0100_0000_01b3)
}

/// A cache of `kinds`' attention layers and `states`' recurrent ones.
pub fn config(
    num_blocks: usize,
    (kinds, block_size): &LayerKinds,
    states: Option<StateLayers>,
) -> KvCacheConfig {
    let mut layers: Vec<LayerKind> = kinds.iter().map(|&kind| kind.into()).collect();
    let (recurrent, slots, interval) = states.unwrap_or((0, 0, 1));
    let layout = KvLayout::default();
    // One slot: K and V of a block's tokens, one head of one dim each.
    let slot_bytes = 2 * block_size * layout.dtype.itemsize();
    // One byte short of `slots` slots, so the last block of a state is not full.
    let state_bytes = (slots * slot_bytes).saturating_sub(1);
    layers.extend((0..recurrent).map(|_| LayerKind::Recurrent { state_bytes }));
    let layout = KvLayout {
        num_layers: layers.len(),
        ..layout
    };
    // Room for a few sequences' states beside the K/V.
    let num_blocks = num_blocks + 3 * recurrent * slots;
    KvCacheConfig::new(num_blocks, *block_size, layout)
        .layer_kinds(&layers)
        .state_checkpoint_interval(interval)
}

impl Harness {
    /// The slot of `block` that stands for the state it holds.
    fn state_slot(&self, block: u32) -> usize {
        block as usize * self.cache.block_size()
    }

    /// The state `seq_id`'s blocks agree on in `tier` (`GARBAGE` where they do not, or hold
    /// none).
    fn held_state(&self, tier: &HashMap<usize, u64>, blocks: &[u32]) -> u64 {
        let mut held = blocks
            .iter()
            .map(|&b| tier.get(&self.state_slot(b)).copied());
        let first = held.next().flatten().unwrap_or(GARBAGE);
        match held.all(|other| other == Some(first)) {
            true => first,
            false => GARBAGE,
        }
    }

    /// The model's recurrent layers over a row of `query` tokens from `start`.
    pub(super) fn advance_state(&mut self, seq_id: u64, start: usize, query: usize) {
        if self.cache.num_state_blocks() == 0 {
            return;
        }
        let blocks = self.cache.state_blocks(seq_id).unwrap().to_vec();
        let mut state = match start {
            0 => STATE_START,
            _ => self.held_state(&self.memory.device, &blocks),
        };
        for position in start..start + query {
            state = fold(state, value(seq_id, self.ids[&seq_id][position], position));
        }
        for block in blocks {
            let slot = self.state_slot(block);
            self.memory.device.insert(slot, state);
        }
    }

    /// `seq_id`'s state blocks hold the fold of its first `computed` tokens (a fork made
    /// behind the scheduler's back, whose parent may be gone: some undamaged state). Before
    /// its first token a state is never read: its blocks may hold anything.
    pub(super) fn check_state(&self, tier: &HashMap<usize, u64>, seq_id: u64, computed: usize) {
        if self.cache.num_state_blocks() == 0 || computed == 0 {
            return;
        }
        let swapped = self.cache.is_swapped(seq_id).unwrap();
        let blocks = self.cache.state_blocks(seq_id).unwrap();
        assert_eq!(blocks.len(), self.cache.num_state_blocks());
        let held = self.held_state(tier, blocks);
        let Some(ids) = self.ids.get(&seq_id) else {
            assert_ne!(held, GARBAGE, "fork {seq_id}'s state");
            return;
        };
        let expected = (0..computed).fold(STATE_START, |state, position| {
            fold(state, value(seq_id, ids[position], position))
        });
        assert_eq!(
            held, expected,
            "sequence {seq_id}'s state after {computed} tokens (swapped: {swapped})"
        );
    }
}

/// `run` over a hybrid cache: `kinds`' attention layers and `states`' recurrent ones.
pub fn run_states(
    config: SchedulerConfig,
    kinds: &LayerKinds,
    ops: Vec<Op>,
    host_prefix: bool,
    states: StateLayers,
) -> Counts {
    let mut harness = Harness::new(config, kinds, host_prefix, Some(states), None);
    for op in &ops {
        harness.apply(op);
        harness.check();
    }
    let stats = harness.cache.stats();
    harness.counts.checkpoints = stats.state_checkpoints_saved;
    harness.counts.hit_tokens = stats.prefix_cache_hit_tokens;
    harness.counts
}

/// Over random hybrids of full attention and recurrent layers, checkpoints are kept and
/// prefix hits resume from them (the properties above check their bytes).
#[test]
fn checkpoints_are_kept_and_hits_resume_from_them() {
    use super::workload::{config, tier_op, STEPS};
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut total = Counts::default();
    for case in 0..150 {
        let config = config().new_tree(&mut runner).unwrap().current();
        let ops = prop::collection::vec(tier_op(), STEPS)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let kinds = (vec![AttentionKind::Full], 1 + case % 3);
        let states = (1 + case % 2, 1 + case % 3, 1 + case % 2);
        let counts = run_states(config, &kinds, ops, case % 4 == 0, states);
        total.checkpoints += counts.checkpoints;
        total.hit_tokens += counts.hit_tokens;
        total.failures += counts.failures;
        total.swaps += counts.swaps;
    }
    println!("{total:?}");
    // Half the configurations prefill whole: those keep checkpoints only on the stride.
    assert!(
        total.checkpoints > 1000 && total.hit_tokens > 150,
        "{total:?}"
    );
    assert!(total.failures > 20 && total.swaps > 20, "{total:?}");
}

/// Attention kinds beside the recurrent layers: full, or a window.
pub fn attention_beside_states() -> impl proptest::strategy::Strategy<Value = LayerKinds> {
    use proptest::prelude::*;
    let kind = prop_oneof![
        Just(AttentionKind::Full),
        (1usize..6).prop_map(|window| AttentionKind::SlidingWindow { window }),
    ];
    (prop::collection::vec(kind, 1..3), 1usize..4)
}
