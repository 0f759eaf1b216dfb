//! Recurrent layers' states in the pool: taken at admission, given back at the end, copied on
//! fork, moved by swaps, counted in every budget, and never a prefix hit without a checkpoint.

use atb_mem_core::{
    AttentionKind, CoreError, KvCache, KvCacheConfig, KvLayout, LayerKind, MissReason, MoveKind,
    StepPlan, Tokens,
};

#[path = "support/scheduler.rs"]
mod scheduler;
use scheduler::scheduler;

#[path = "support/recurrent.rs"]
mod recurrent;
use recurrent::{hybrid, hybrid_config, BLOCK_SIZE, SLOT_BYTES};

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
    let error = KvCacheConfig::new(64, 4, layout)
        .layer_kinds(&big)
        .build()
        .unwrap_err();
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

/// Sequence 1 computes `prompt` with a checkpoint at `at` tokens, then ends: what it leaves
/// is cached. Returns the checkpoint's blocks (the destinations of its copies).
fn leave_checkpoint(cache: &mut KvCache, prompt: &[u32], at: usize) -> Vec<u32> {
    let mut moves = Vec::new();
    cache.alloc_sequence(1, Tokens::Ids(prompt), None).unwrap();
    cache.take_moves(&mut moves);
    cache.mark_computed(1, Some(at)).unwrap();
    assert!(cache.checkpoint_state(1).unwrap());
    assert!(
        !cache.checkpoint_state(1).unwrap(),
        "one checkpoint per position"
    );
    cache.take_moves(&mut moves);
    let state = cache.state_blocks(1).unwrap().to_vec();
    assert_eq!(moves.len(), state.len());
    assert!(moves.iter().all(|m| m.kind == MoveKind::Copy));
    assert_eq!(moves.iter().map(|m| m.src).collect::<Vec<_>>(), state);
    cache.mark_computed(1, Some(prompt.len())).unwrap();
    cache.free_sequence(1).unwrap();
    moves.iter().map(|m| m.dst).collect()
}

#[test]
fn a_hit_resumes_from_the_last_checkpoint_the_kv_reaches() {
    let mut cache = hybrid(60);
    let prompt: Vec<u32> = (0..13).collect();
    let checkpoint = leave_checkpoint(&mut cache, &prompt, 8);
    assert_eq!(cache.stats().state_checkpoints_saved, 1);
    // Three K/V blocks are cached, but states only at 8 tokens.
    let longer: Vec<u32> = (0..19).collect();
    let why = cache.explain_prefix(&longer, None).unwrap();
    assert_eq!(
        (why.hit_tokens, why.reason, why.limited_by),
        (8, MissReason::StateCheckpoint, None)
    );
    assert_eq!(why.groups[0].cached_tokens, 12);
    let mut moves = Vec::new();
    assert_eq!(
        cache.alloc_sequence(2, Tokens::Ids(&longer), None).unwrap(),
        8
    );
    cache.take_moves(&mut moves);
    let state = cache.state_blocks(2).unwrap().to_vec();
    let copies: Vec<(u32, u32)> = moves.iter().map(|m| (m.src, m.dst)).collect();
    let expected: Vec<(u32, u32)> = checkpoint.iter().copied().zip(state).collect();
    assert_eq!(copies, expected);
    // The checkpoint stays cached, unused; the miss is counted as the state's.
    assert!(checkpoint
        .iter()
        .all(|&b| cache.block_pool().ref_count(b) == 0));
    assert_eq!(cache.stats().prefix_cache_misses[5], 1);
    assert_eq!(cache.num_computed(2).unwrap(), 8);
    cache.check_invariants().unwrap();
    // Without a checkpoint within the K/V's reach there is no hit at all.
    let other: Vec<u32> = (0..7).collect();
    let why = cache.explain_prefix(&other, None).unwrap();
    assert_eq!(
        (why.hit_tokens, why.reason),
        (0, MissReason::StateCheckpoint)
    );
}

#[test]
fn checkpoints_are_kept_on_the_stride_of_known_tokens_only() {
    assert!(hybrid_config(60)
        .state_checkpoint_interval(0)
        .build()
        .is_err());
    let mut cache = hybrid_config(60)
        .state_checkpoint_interval(2)
        .build()
        .unwrap();
    assert_eq!(cache.checkpoint_stride(), 8);
    let prompt: Vec<u32> = (0..13).collect();
    cache.alloc_sequence(1, Tokens::Ids(&prompt), None).unwrap();
    // On the stride (8), and at the prompt's last block boundary (12) whatever the stride.
    for (computed, due) in [(4, false), (6, false), (8, true), (12, true)] {
        cache.mark_computed(1, Some(computed)).unwrap();
        assert_eq!(cache.checkpoint_due(1), due, "{computed}");
        assert_eq!(cache.checkpoint_state(1).unwrap(), due, "{computed}");
    }
    // A prompt given as a count has no names to keep a checkpoint under.
    cache.alloc_sequence(2, Tokens::Count(9), None).unwrap();
    cache.mark_computed(2, Some(8)).unwrap();
    assert!(!cache.checkpoint_state(2).unwrap());
    assert!(matches!(
        cache.checkpoint_state(3),
        Err(CoreError::UnknownSequence(3))
    ));
    // Swapped out, a sequence keeps none.
    cache
        .alloc_sequence(4, Tokens::Ids(&prompt[..9]), None)
        .unwrap();
    cache.mark_computed(4, Some(8)).unwrap();
    cache.swap_out(&[4]).unwrap();
    assert!(!cache.checkpoint_state(4).unwrap());
    assert_eq!(cache.stats().state_checkpoints_saved, 2);
    cache.check_invariants().unwrap();
}

#[test]
fn a_checkpoint_missing_a_block_serves_no_hit() {
    let mut cache = hybrid(60);
    let prompt: Vec<u32> = (0..13).collect();
    let checkpoint = leave_checkpoint(&mut cache, &prompt, 4);
    // Take every free block but one of the cached ones: the least recently used go first.
    let free = cache.num_free_blocks();
    cache
        .alloc_sequence(9, Tokens::Count((free - 1 - 6) * BLOCK_SIZE), None)
        .unwrap();
    let evicted = checkpoint
        .iter()
        .filter(|&&b| cache.block_pool().ref_count(b) > 0)
        .count();
    assert!(evicted > 0, "the test evicts part of the checkpoint");
    cache.free_sequence(9).unwrap();
    let why = cache.explain_prefix(&prompt, None).unwrap();
    assert_eq!(why.hit_tokens, 0);
    assert_eq!(
        cache.alloc_sequence(2, Tokens::Ids(&prompt), None).unwrap(),
        0
    );
    // Computed again, the checkpoint is made whole: its surviving blocks stay, the missing
    // ones are saved anew, and the next prompt resumes from it.
    cache.mark_computed(2, Some(4)).unwrap();
    assert!(cache.checkpoint_state(2).unwrap());
    assert_eq!(cache.explain_prefix(&prompt, None).unwrap().hit_tokens, 4);
    cache.check_invariants().unwrap();
}

#[test]
fn a_checkpoint_that_does_not_fit_beside_the_admission_is_given_up() {
    // 39 usable blocks: a checkpoint (6) held while the admission takes its own.
    let mut cache = hybrid(40);
    let prompt: Vec<u32> = (0..13).collect();
    leave_checkpoint(&mut cache, &prompt, 8);
    let long: Vec<u32> = (0..(39 - 6) as u32 * BLOCK_SIZE as u32 - 3).collect();
    // The whole pool: its own blocks and states leave no room to hold the checkpoint.
    let before = cache.clone();
    let needed = cache.blocks_to_allocate(Tokens::Ids(&long), None).unwrap();
    assert!(needed <= cache.num_free_blocks());
    assert_eq!(cache.explain_prefix(&long, None).unwrap().hit_tokens, 0);
    assert_eq!(
        cache.alloc_sequence(2, Tokens::Ids(&long), None).unwrap(),
        0
    );
    let mut moves = Vec::new();
    cache.take_moves(&mut moves);
    assert!(moves.is_empty(), "{moves:?}");
    cache.check_invariants().unwrap();
    // With room, the same prompt resumes at 8.
    let mut cache = before;
    cache.alloc_sequence(3, Tokens::Count(1), None).unwrap();
    cache.free_sequence(3).unwrap();
    let short: Vec<u32> = (0..20).collect();
    assert_eq!(
        cache.alloc_sequence(2, Tokens::Ids(&short), None).unwrap(),
        8
    );
}

#[test]
fn a_failed_admission_leaves_the_checkpoints_as_they_were() {
    let mut cache = hybrid(40);
    let prompt: Vec<u32> = (0..13).collect();
    leave_checkpoint(&mut cache, &prompt, 8);
    cache.alloc_sequence(5, Tokens::Count(20), None).unwrap();
    let observe = |cache: &mut KvCache| {
        let why = cache.explain_prefix(&prompt, None).unwrap();
        let held = cache.state_blocks(5).unwrap().to_vec();
        (cache.stats(), why, held, cache.num_pending_moves())
    };
    let before = observe(&mut cache);
    let too_long: Vec<u32> = (0..100).collect();
    let error = cache
        .alloc_sequence(2, Tokens::Ids(&too_long), None)
        .unwrap_err();
    assert!(matches!(error, CoreError::OutOfBlocks { .. }), "{error}");
    assert_eq!(observe(&mut cache), before);
    assert_eq!(before.1.hit_tokens, 8);
}

#[test]
fn without_checkpoints_no_prefix_is_a_hit() {
    let mut cache = hybrid(40);
    let prompt: Vec<u32> = (0..13).collect();
    cache.alloc_sequence(1, Tokens::Ids(&prompt), None).unwrap();
    cache.mark_computed(1, Some(13)).unwrap();
    cache.free_sequence(1).unwrap();
    // The K/V blocks are cached, but no state was kept.
    assert_eq!(cache.block_pool().num_cached(), 3);
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
    assert!(hybrid_config(40).hash_block_size(2).build().is_err());
    cache.check_invariants().unwrap();
}

#[test]
fn a_checkpoint_is_due_where_the_cached_kv_a_prompt_shares_ends() {
    let mut cache = hybrid_config(60)
        .state_checkpoint_interval(4)
        .build()
        .unwrap();
    let system: Vec<u32> = (0..13).collect();
    cache.alloc_sequence(1, Tokens::Ids(&system), None).unwrap();
    cache.mark_computed(1, Some(13)).unwrap();
    cache.free_sequence(1).unwrap();
    // The next prompt shares 12 tokens of cached K/V but no state: it recomputes them, and
    // its states after them are kept for the one after it.
    let mut second = system[..12].to_vec();
    second.extend([90, 91, 92, 93, 94]);
    assert_eq!(
        cache.alloc_sequence(2, Tokens::Ids(&second), None).unwrap(),
        0
    );
    assert_eq!(cache.kv_reach(2).unwrap(), 12);
    cache.mark_computed(2, Some(8)).unwrap();
    assert!(!cache.checkpoint_due(2));
    cache.mark_computed(2, Some(12)).unwrap();
    assert!(cache.checkpoint_due(2) && cache.checkpoint_state(2).unwrap());
    let mut third = system[..12].to_vec();
    third.extend([70, 71]);
    assert_eq!(cache.explain_prefix(&third, None).unwrap().hit_tokens, 12);
    cache.check_invariants().unwrap();
}

/// The scheduler ends a prompt's chunk on the checkpoint stride, saves the states there at
/// the next step's start, and a next prompt resumes from them; a save whose copies fail is
/// dropped and the step goes on — but with a host prefix cache, whose demotions of what the
/// save evicts are moves too, the step is one transaction and fails whole.
#[test]
fn the_scheduler_keeps_checkpoints_and_drops_failed_saves() {
    for (fail, host_prefix) in [(false, false), (true, false), (true, true)] {
        let mut cache = hybrid_config(80)
            .host_prefix_cache(host_prefix)
            .build()
            .unwrap();
        let mut scheduler = scheduler(&cache, 4, 64, 0.0);
        let prompt: Vec<u32> = (0..10).collect();
        scheduler
            .add_request(&mut cache, 1, Tokens::Ids(&prompt), 1, 1, 0, 0)
            .unwrap();
        let mut plan = StepPlan::default();
        scheduler.step(&mut cache, 0, &mut plan).unwrap();
        assert_eq!(
            plan.prefill_tokens,
            vec![8],
            "the chunk ends on the last boundary"
        );
        let mut executed = Vec::new();
        let execute = |moves: &[atb_mem_core::BlockMove]| {
            executed.extend_from_slice(moves);
            match fail {
                true => Err(atb_mem_core::MoveFailure { attempted: 1 }),
                false => Ok(()),
            }
        };
        let stepped = scheduler.step_executing(&mut cache, 0, &mut plan, execute);
        if host_prefix {
            assert!(
                matches!(stepped, Err(CoreError::MovesFailed { .. })),
                "{stepped:?}"
            );
            assert_eq!(cache.stats().state_checkpoints_saved, 0);
            assert_eq!(cache.explain_prefix(&prompt, None).unwrap().hit_tokens, 0);
            cache.check_invariants().unwrap();
            continue;
        }
        stepped.unwrap();
        assert_eq!(
            executed.len(),
            cache.num_state_blocks(),
            "the save's copies"
        );
        assert_eq!(plan.prefill_tokens, vec![2], "the step goes on either way");
        assert_eq!(
            plan.moves.len(),
            usize::from(!fail) * cache.num_state_blocks()
        );
        let stats = cache.stats();
        let counted = (
            stats.state_checkpoints_saved,
            stats.state_checkpoints_failed,
        );
        assert_eq!(counted, (u64::from(!fail), u64::from(fail)));
        let mut next = prompt[..8].to_vec();
        next.extend([50, 51, 52]);
        let why = cache.explain_prefix(&next, None).unwrap();
        assert_eq!(why.hit_tokens, if fail { 0 } else { 8 });
        cache.check_invariants().unwrap();
    }
}

#[test]
fn checkpoints_are_not_demoted_to_the_host_prefix_cache() {
    let mut cache = hybrid_config(40).host_prefix_cache(true).build().unwrap();
    let prompt: Vec<u32> = (0..13).collect();
    leave_checkpoint(&mut cache, &prompt, 8);
    assert_eq!(cache.block_pool().num_cached(), 3 + 6);
    // Every free block taken: the K/V blocks go to the host, the checkpoint's do not (no
    // hit resumes from a host copy of one).
    let free = cache.num_free_blocks();
    cache
        .alloc_sequence(9, Tokens::Count((free - 6) * BLOCK_SIZE), None)
        .unwrap();
    assert_eq!(cache.block_pool().num_cached(), 0);
    assert_eq!(cache.num_host_cached_blocks(), 3);
    assert_eq!(cache.host_prefix_counters().demoted, 3);
    cache.check_invariants().unwrap();
}

/// A lookup that finds a checkpoint and is not followed by an admission (`explain_prefix`,
/// a budget check) leaves nothing behind for the next admission, one of a token count.
#[test]
fn a_checkpoint_found_by_a_lookup_alone_is_not_taken_by_the_next_admission() {
    let mut cache = hybrid(60);
    let prompt: Vec<u32> = (0..13).collect();
    leave_checkpoint(&mut cache, &prompt, 8);
    assert_eq!(cache.explain_prefix(&prompt, None).unwrap().hit_tokens, 8);
    let free = cache.num_free_blocks();
    cache.alloc_sequence(2, Tokens::Count(5), None).unwrap();
    assert_eq!(
        cache.num_pending_moves(),
        0,
        "no copy into a fresh sequence's states"
    );
    assert_eq!(cache.num_free_blocks(), free - 2 - cache.num_state_blocks());
    cache.free_sequence(2).unwrap();
    assert_eq!(cache.num_free_blocks(), free);
    cache.check_invariants().unwrap();
}

/// Without chunked prefill a prompt runs whole: no chunk ends where a checkpoint would be.
#[test]
fn without_chunked_prefill_a_hybrid_prompt_is_not_split_for_its_checkpoint() {
    let mut cache = hybrid(80);
    let mut scheduler = scheduler(&cache, 4, 64, 0.0);
    let mut config = scheduler.config();
    config.enable_chunked_prefill = false;
    scheduler.set_config(config, &cache).unwrap();
    let prompt: Vec<u32> = (0..10).collect();
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&prompt), 1, 1, 0, 0)
        .unwrap();
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 0, &mut plan).unwrap();
    assert_eq!(plan.prefill_tokens, vec![10]);
}
