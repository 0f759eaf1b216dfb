//! Recurrent layers' states in the pool: taken at admission, given back at the end, copied on
//! fork, moved by swaps, counted in every budget, and never a prefix hit without a checkpoint.

use atb_mem_core::{
    AttentionKind, CoreError, KvCache, KvDtype, KvLayout, LayerKind, MissReason, MoveKind, Tokens,
};

const BLOCK_SIZE: usize = 4;
/// Bytes of one layer's K/V slot in a block: 2 × 4 tokens × 1 head × 2 dims × 2 bytes.
const SLOT_BYTES: usize = 32;

/// Layers `[recurrent, recurrent, full, recurrent, recurrent, full]`, each state 2.5 slots:
/// groups of two layers, two state groups of three blocks each.
fn hybrid(num_blocks: usize) -> KvCache {
    let state = LayerKind::Recurrent {
        state_bytes: SLOT_BYTES * 5 / 2,
    };
    let full = LayerKind::Attention(AttentionKind::Full);
    let kinds = [state, state, full, state, state, full];
    let layout = KvLayout {
        num_layers: kinds.len(),
        num_kv_heads: 1,
        head_dim: 2,
        dtype: KvDtype::Float16,
    };
    let mut cache =
        KvCache::with_layer_kinds(num_blocks, BLOCK_SIZE, layout, true, &kinds).unwrap();
    cache.enable_host_tier(32).unwrap();
    cache
}

#[test]
fn states_are_grouped_sized_and_placed() {
    let cache = hybrid(40);
    assert_eq!(cache.layers_per_block(), 2);
    assert_eq!(cache.bytes_per_block(), 2 * SLOT_BYTES);
    let groups = cache.state_groups();
    assert_eq!(groups.len(), 2);
    assert_eq!(
        (groups[0].layers.clone(), groups[0].num_blocks),
        (vec![0, 1], 3)
    );
    assert_eq!((groups[1].first_column, groups[1].num_blocks), (3, 3));
    assert_eq!(cache.num_state_blocks(), 6);
    assert_eq!(cache.state_of_layer(4).unwrap(), (1, 1));
    assert_eq!(cache.group_of_layer(5).unwrap(), (0, 1));
    let not_a_state = cache.state_of_layer(2).unwrap_err().to_string();
    assert!(not_a_state.contains("attention layer"), "{not_a_state}");
    let not_kv = cache.group_of_layer(3).unwrap_err().to_string();
    assert!(not_kv.contains("recurrent"), "{not_kv}");
    assert!(cache.state_of_layer(6).is_err());
    // 39 usable blocks, 6 of them a sequence's states: 33 blocks of 4 tokens.
    assert_eq!(cache.max_seq_tokens(), 33 * BLOCK_SIZE);
    // A pool that cannot hold one sequence's states is refused.
    let layout = KvLayout {
        num_layers: 2,
        ..KvLayout::default()
    };
    let big = [
        LayerKind::Recurrent {
            state_bytes: 1 << 20,
        },
        LayerKind::Attention(AttentionKind::Full),
    ];
    let error = KvCache::with_layer_kinds(64, 4, layout, true, &big).unwrap_err();
    assert!(
        error.to_string().contains("recurrent states take"),
        "{error}"
    );
}

#[test]
fn a_sequence_holds_its_states_from_admission_to_its_end() {
    let mut cache = hybrid(40);
    let free = cache.num_free_blocks();
    let tokens = Tokens::Ids(&[1, 2, 3, 4, 5]);
    assert_eq!(cache.blocks_to_allocate(tokens, None).unwrap(), 2 + 6);
    cache.alloc_sequence(7, tokens, None).unwrap();
    assert_eq!(cache.num_free_blocks(), free - 8);
    assert_eq!(cache.num_held_blocks(7).unwrap(), 8);
    let state = cache.state_blocks(7).unwrap().to_vec();
    assert_eq!(state.len(), 6);
    let kv: Vec<u32> = cache.block_table(7).unwrap().to_vec();
    assert!(state.iter().all(|block| !kv.contains(block)));
    let mut table = vec![0i32; 6];
    cache.state_table(&[7], &mut table).unwrap();
    assert_eq!(table, state.iter().map(|&b| b as i32).collect::<Vec<_>>());
    assert!(cache.state_table(&[7, 8], &mut [0; 12]).is_err());
    assert!(cache.state_table(&[7], &mut [0; 5]).is_err());
    cache.check_invariants().unwrap();
    cache.free_sequence(7).unwrap();
    assert_eq!(cache.num_free_blocks(), free);
    cache.check_invariants().unwrap();
}

#[test]
fn a_budget_short_of_the_states_admits_nothing() {
    let mut cache = hybrid(20); // 19 usable
    cache.alloc_sequence(1, Tokens::Count(1), None).unwrap();
    assert_eq!(cache.num_free_blocks(), 12);
    let before = cache.clone();
    let error = cache
        .alloc_sequence(2, Tokens::Count(7 * BLOCK_SIZE), None)
        .unwrap_err();
    assert!(
        matches!(error, CoreError::OutOfBlocks { needed: 13, .. }),
        "{error}"
    );
    assert_eq!(cache.num_free_blocks(), before.num_free_blocks());
    assert_eq!(cache.num_sequences(), 1);
    cache
        .alloc_sequence(2, Tokens::Count(6 * BLOCK_SIZE), None)
        .unwrap();
    assert_eq!(cache.num_free_blocks(), 0);
    // What no pool of this size could hold says so, states counted.
    let never = cache
        .alloc_sequence(3, Tokens::Count(14 * BLOCK_SIZE), None)
        .unwrap_err();
    assert!(never.to_string().contains("6 of them"), "{never}");
    cache.check_invariants().unwrap();
}

#[test]
fn a_fork_copies_the_parents_state_into_its_own_blocks() {
    let mut cache = hybrid(40);
    cache
        .alloc_sequence(1, Tokens::Ids(&[1, 2, 3, 4, 5, 6]), None)
        .unwrap();
    let mut moves = Vec::new();
    cache.take_moves(&mut moves);
    cache.mark_computed(1, Some(6)).unwrap();
    let free = cache.num_free_blocks();
    cache.fork(1, 2).unwrap();
    // K/V blocks are shared; the state is not.
    assert_eq!(cache.block_table(2).unwrap(), cache.block_table(1).unwrap());
    assert_eq!(cache.num_free_blocks(), free - 6);
    let (parent, child) = (
        cache.state_blocks(1).unwrap(),
        cache.state_blocks(2).unwrap(),
    );
    assert!(parent.iter().all(|block| !child.contains(block)));
    let copies: Vec<(u32, u32)> = cache
        .pending_moves()
        .iter()
        .map(|planned| {
            assert_eq!(planned.kind, MoveKind::Copy);
            (planned.src, planned.dst)
        })
        .collect();
    let expected: Vec<(u32, u32)> = parent.iter().copied().zip(child.iter().copied()).collect();
    assert_eq!(copies, expected);
    cache.check_invariants().unwrap();
    cache.free_sequence(1).unwrap();
    cache.free_sequence(2).unwrap();
    cache.check_invariants().unwrap();
}

#[test]
fn a_fork_without_blocks_for_its_state_changes_nothing() {
    // 14 usable blocks: the parent takes 3 + 6, leaving 5, short of a state's 6.
    let mut tight = hybrid(15);
    tight
        .alloc_sequence(1, Tokens::Count(3 * BLOCK_SIZE), None)
        .unwrap();
    let before = tight.pending_moves().len();
    let error = tight.fork(1, 2).unwrap_err();
    assert!(
        matches!(
            error,
            CoreError::OutOfBlocks {
                needed: 6,
                available: 5
            }
        ),
        "{error}"
    );
    assert!(!tight.contains(2));
    assert_eq!(tight.num_free_blocks(), 5);
    assert_eq!(tight.pending_moves().len(), before);
    tight.check_invariants().unwrap();
    // One block more, and it fits exactly.
    let mut fits = hybrid(16);
    fits.alloc_sequence(1, Tokens::Count(3 * BLOCK_SIZE), None)
        .unwrap();
    fits.fork(1, 2).unwrap();
    assert_eq!(fits.num_free_blocks(), 0);
    fits.check_invariants().unwrap();
}

#[test]
fn a_swap_moves_the_state_with_the_sequence() {
    let mut cache = hybrid(40);
    cache.alloc_sequence(1, Tokens::Count(6), None).unwrap();
    let mut moves = Vec::new();
    cache.take_moves(&mut moves);
    let state = cache.state_blocks(1).unwrap().to_vec();
    let free = cache.num_free_blocks();
    cache.swap_out(&[1]).unwrap();
    cache.take_moves(&mut moves);
    assert_eq!(moves.len(), 2 + 6);
    let moved: Vec<u32> = moves.iter().map(|planned| planned.src).collect();
    assert!(state.iter().all(|block| moved.contains(block)));
    assert!(moves.iter().all(|planned| planned.kind == MoveKind::ToHost));
    assert_eq!(cache.num_free_blocks(), free + 8);
    assert!(cache.state_table(&[1], &mut [0; 6]).is_err()); // on the host: no kernel reads it
    cache.check_invariants().unwrap();
    cache.swap_in(&[1]).unwrap();
    cache.take_moves(&mut moves);
    assert_eq!(moves.len(), 8);
    assert!(moves
        .iter()
        .all(|planned| planned.kind == MoveKind::ToDevice));
    assert_eq!(cache.state_blocks(1).unwrap().len(), 6);
    cache.check_invariants().unwrap();
    // Freed while swapped out, its host blocks go back too.
    cache.swap_out(&[1]).unwrap();
    cache.free_sequence(1).unwrap();
    assert_eq!(cache.num_free_host_blocks(), 32);
    cache.check_invariants().unwrap();
}

#[test]
fn without_state_checkpoints_no_prefix_is_a_hit() {
    let mut cache = hybrid(40);
    let prompt: Vec<u32> = (0..13).collect();
    cache.alloc_sequence(1, Tokens::Ids(&prompt), None).unwrap();
    cache.mark_computed(1, Some(13)).unwrap();
    cache.free_sequence(1).unwrap();
    assert_eq!(cache.block_pool().num_cached(), 0);
    let why = cache.explain_prefix(&prompt, None).unwrap();
    assert_eq!(
        (why.hit_tokens, why.reason),
        (0, MissReason::StateCheckpoint)
    );
    assert_eq!(why.reason.name(), "state_checkpoint");
    assert_eq!(
        cache.alloc_sequence(2, Tokens::Ids(&prompt), None).unwrap(),
        0
    );
    assert!(cache.set_hash_block_size(2).is_err());
    cache.check_invariants().unwrap();
}
