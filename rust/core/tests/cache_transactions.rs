//! The cache's compound operations as transactions (swap out, swap in, executing pending
//! moves, readying a write): an executor that fails after any number of moves leaves the
//! cache as it was, less the sequences whose bytes it destroyed; one that fails before any
//! move, or an operation refused up front, leaves it byte for byte as it was.

use atb_mem_core::{BlockMove, CoreError, KvCache, KvCacheConfig, KvLayout, MoveFailure, Tokens};

#[path = "support/state.rs"]
mod state;
use state::cache_state as state;

/// Two sequences sharing a prefix, a third of their own, and a fork whose copy-on-write
/// copy is pending: every swap also carries an earlier copy.
fn cache_with_pending_copy() -> KvCache {
    let mut cache = KvCacheConfig::new(24, 2, KvLayout::default())
        .host_blocks(16)
        .build()
        .unwrap();
    let shared: Vec<u32> = vec![5, 6, 7, 8, 9];
    cache.alloc_sequence(1, Tokens::Ids(&shared), None).unwrap();
    cache.mark_computed(1, None).unwrap();
    let mut longer = shared.clone();
    longer.extend([1, 2]);
    cache.alloc_sequence(2, Tokens::Ids(&longer), None).unwrap();
    cache.alloc_sequence(3, Tokens::Count(3), None).unwrap();
    cache.fork(1, 4).unwrap();
    cache
        .append_tokens(&[4], 1, Some(&[3]), &mut Vec::new())
        .unwrap();
    assert!(cache.num_pending_moves() > 0);
    cache
}

type Operation = fn(
    &mut KvCache,
    &mut dyn FnMut(&[BlockMove]) -> Result<(), MoveFailure>,
    &mut Vec<BlockMove>,
) -> Result<(), CoreError>;

const OPERATIONS: [(&str, Operation); 3] = [
    ("swap out", |cache, execute, executed| {
        cache.swap_out_executing(&[1, 3], execute, executed)
    }),
    ("execute pending", |cache, execute, executed| {
        cache.execute_pending_moves(execute, executed)
    }),
    ("swap in", |cache, execute, executed| {
        if !cache.is_swapped(2).unwrap() {
            cache.swap_out(&[2]).unwrap();
            cache.take_moves(&mut Vec::new());
        }
        cache.swap_in_executing(&[2], execute, executed)
    }),
];

#[test]
fn an_executor_failing_after_any_move_costs_only_the_damaged_sequences() {
    for (name, operation) in OPERATIONS {
        // The moves the operation plans, from a run that succeeds.
        let mut planned = Vec::new();
        let mut cache = cache_with_pending_copy();
        operation(&mut cache, &mut |_| Ok(()), &mut planned).unwrap();
        assert!(!planned.is_empty(), "{name}");
        for attempted in 0..=planned.len() {
            let mut cache = cache_with_pending_copy();
            let mut executed = Vec::new();
            let mut execute = |moves: &[BlockMove]| {
                assert_eq!(moves, planned.as_slice());
                Err(MoveFailure { attempted })
            };
            if name == "swap in" {
                cache.swap_out(&[2]).unwrap();
                cache.take_moves(&mut Vec::new());
            }
            let reference = cache.clone();
            let error = operation(&mut cache, &mut execute, &mut executed).unwrap_err();
            let CoreError::MovesFailed { aborted, .. } = error else {
                panic!("{name}: {error}");
            };
            cache.check_invariants().unwrap();
            for seq_id in reference.seq_ids() {
                let ended = aborted.contains(&seq_id);
                assert_eq!(
                    ended,
                    !cache.contains(seq_id),
                    "{name}, {attempted}: {seq_id}"
                );
                if !ended {
                    assert_eq!(
                        cache.seq_len_and_tier(seq_id),
                        reference.seq_len_and_tier(seq_id)
                    );
                    assert_eq!(
                        cache.group_block_table(seq_id, 0).unwrap(),
                        reference.group_block_table(seq_id, 0).unwrap()
                    );
                }
            }
            // What was pending before the operation is pending again: its replay rewrites
            // (heals) its destinations.
            assert_eq!(cache.pending_moves(), reference.pending_moves(), "{name}");
            if attempted == 0 {
                assert!(aborted.is_empty(), "{name}");
                assert_eq!(state(&cache), state(&reference), "{name}: nothing ran");
            }
        }
    }
}

#[test]
fn refused_operations_change_nothing_and_execute_nothing() {
    let mut cache = cache_with_pending_copy();
    let before = state(&cache);
    let mut never = |_: &[BlockMove]| -> Result<(), MoveFailure> { panic!("executed") };
    let mut executed = Vec::new();
    for refused in [
        cache.swap_out_executing(&[1, 99], &mut never, &mut executed),
        cache.swap_out_executing(&[1, 1], &mut never, &mut executed),
        cache.swap_in_executing(&[1], &mut never, &mut executed),
        cache.prepare_write(&[0, 1], &mut never), // the null block
        cache.prepare_write(&[2 * 23], &mut never), // a free block
    ] {
        assert!(refused.is_err());
        assert_eq!(state(&cache), before);
    }
}

#[test]
fn a_write_into_a_held_slot_runs_the_pending_copy_first() {
    let mut cache = cache_with_pending_copy();
    let pending = cache.pending_moves().to_vec();
    let slot = cache.group_block_table(4, 0).unwrap()[0] as i32 * 2;
    let mut seen = Vec::new();
    cache
        .prepare_write(&[slot, -1], |moves| {
            seen.extend_from_slice(moves);
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, pending);
    assert_eq!(cache.num_pending_moves(), 0);
}
