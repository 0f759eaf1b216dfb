//! The harness is not vacuous: over deterministic runs, what the model test means to
//! exercise does happen, often.

use atb_mem_core::AttentionKind;
use proptest::prelude::*;
use proptest::strategy::ValueTree;

use super::turns::turn_op;
use super::workload::*;
use super::{run, run_policy, Counts};
use atb_mem_core::EvictionPolicy;

/// The harness is not vacuous: copies, swaps, prefix hits and injected failures happen.
#[test]
fn injected_failures_happen_and_sometimes_cost_requests() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut total = Counts::default();
    for _ in 0..200 {
        let config = config().new_tree(&mut runner).unwrap().current();
        let ops = prop::collection::vec(op(), STEPS)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let counts = run(config, &(vec![AttentionKind::Full], BLOCK_SIZE), ops, false);
        total.copies += counts.copies;
        total.swaps += counts.swaps;
        total.hit_steps += counts.hit_steps;
        total.failures += counts.failures;
        total.aborted_by_recovery += counts.aborted_by_recovery;
        total.forked_requests += counts.forked_requests;
        total.tampered_steps += counts.tampered_steps;
    }
    println!("{total:?}");
    assert!(total.copies > 20 && total.swaps > 100, "{total:?}");
    assert!(total.hit_steps > 100 && total.failures > 20, "{total:?}");
    assert!(total.forked_requests > 50, "{total:?}");
    assert!(total.tampered_steps > 200, "{total:?}");
    // Recoveries that must end a request (a swap-out's freed block rewritten by a later
    // move of the same step) are rare here; tests/test_correct_under_load.py pins one down.
}

/// Over random hybrid models, windows release blocks and prefix hits still happen.
#[test]
fn hybrid_models_release_windows_and_still_hit() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut total = Counts::default();
    for _ in 0..200 {
        let config = config().new_tree(&mut runner).unwrap().current();
        let kinds = layer_kinds().new_tree(&mut runner).unwrap().current();
        let ops = prop::collection::vec(op(), STEPS)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let counts = run(config, &kinds, ops, false);
        total.windowed_releases += counts.windowed_releases;
        total.hit_steps += counts.hit_steps;
        total.swaps += counts.swaps;
        total.grouped_events += counts.grouped_events;
    }
    println!("{total:?}");
    assert!(total.windowed_releases > 300, "{total:?}");
    assert!(total.grouped_events > 1000, "{total:?}");
    assert!(total.hit_steps > 100 && total.swaps > 100, "{total:?}");
}

/// Prefix keys at every token (`hash_block_size = 1`) on blocks of 2 to 4 tokens, with and
/// without a host prefix tier, under every policy: every computed byte survives the partial
/// hits' copies, injected failures and preemptions, and partial hits happen often, from
/// full blocks and from ended sequences' last blocks (cached by their pieces) alike.
#[test]
fn sub_block_hits_keep_every_computed_byte() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut total = Counts::default();
    for case in 0..300 {
        let config = config().new_tree(&mut runner).unwrap().current();
        let block_size = 2 + case % 3;
        let ops = prop::collection::vec(turn_op(), STEPS)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let policy = EvictionPolicy::ALL[case % EvictionPolicy::ALL.len()];
        let kinds = (vec![AttentionKind::Full], block_size);
        let counts = run_policy(config, &kinds, ops, case % 2 == 0, (policy, 1));
        total.partial_hit_tokens += counts.partial_hit_tokens;
        total.tail_copies += counts.tail_copies;
        total.failures += counts.failures;
        total.hit_steps += counts.hit_steps;
    }
    println!("{total:?}");
    assert!(total.partial_hit_tokens > 300, "{total:?}");
    assert!(total.tail_copies > 30, "{total:?}");
    assert!(total.failures > 20 && total.hit_steps > 100, "{total:?}");
}
