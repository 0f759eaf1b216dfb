//! The tiers in the scheduler model: a write-through store below the host whose loads
//! arrive late or fail part-way, and the tests that drive a small device through them.

use atb_mem_core::{AttentionKind, SchedulerConfig};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

use super::workload::*;
use super::{chain, run, Counts, Harness};

impl Harness {
    /// Offers the scheduler the leading blocks of `prompt` the store holds.
    pub(super) fn offer_stored_prefix(&mut self, seq_id: u64, prompt: &[u32]) {
        let Some(store) = &self.store else {
            return;
        };
        let block_size = self.cache.block_size();
        let most = (prompt.len() - 1) / block_size;
        let held = chain::chain(prompt, block_size)
            .into_iter()
            .take(most)
            .take_while(|hash| store.contains_key(hash))
            .count();
        if held > 0 {
            self.scheduler
                .offer_external_prefix(&self.cache, seq_id, held)
                .unwrap();
        }
    }

    /// Puts every computed full block of every request into the store (write-through).
    pub(super) fn store_computed(&mut self) {
        let Some(store) = self.store.as_mut() else {
            return;
        };
        let block_size = self.cache.block_size();
        for (&seq_id, ids) in &self.ids {
            let Ok(computed) = self.cache.num_computed(seq_id) else {
                continue;
            };
            let Some(known) = ids.iter().copied().collect::<Option<Vec<u32>>>() else {
                continue;
            };
            for (index, hash) in chain::chain(&known, block_size).into_iter().enumerate() {
                if (index + 1) * block_size > computed {
                    break;
                }
                let values = (index * block_size..(index + 1) * block_size)
                    .map(|position| value(seq_id, Some(known[position]), position))
                    .collect();
                store.entry(hash).or_insert(values);
            }
        }
    }

    /// Reports one load in flight: on `ok` its blocks get the stored bytes first; otherwise
    /// it half-writes them with garbage, as a load that fails part-way does.
    pub(super) fn finish_load(&mut self, pick: usize, ok: bool) {
        if self.loads.is_empty() {
            return;
        }
        let (seq_id, blocks) = self.loads.remove(pick % self.loads.len());
        let block_size = self.cache.block_size();
        let store = self.store.as_ref().unwrap();
        for (index, &(block, hash)) in blocks.iter().enumerate() {
            if !ok && index > 0 {
                break; // it failed after half-writing its first block
            }
            for (offset, &stored) in store[&hash].iter().enumerate() {
                let slot = block as usize * block_size + offset;
                let written = if ok { stored } else { GARBAGE };
                self.memory.device.insert(slot, written);
            }
        }
        self.scheduler
            .finish_loads(&mut self.cache, &[seq_id], &[ok])
            .unwrap();
        self.counts.loads += 1;
        self.counts.failed_loads += usize::from(!ok);
    }
}

/// A tier workload's case: a configuration, a one-group model on even cases and a random
/// hybrid one on odd cases, and the operations.
fn tier_case(
    runner: &mut proptest::test_runner::TestRunner,
    case: usize,
) -> (SchedulerConfig, LayerKinds, Vec<Op>) {
    let config = config().new_tree(runner).unwrap().current();
    let kinds = match case % 2 {
        0 => (vec![AttentionKind::Full], BLOCK_SIZE),
        _ => layer_kinds().new_tree(runner).unwrap().current(),
    };
    let ops = prop::collection::vec(tier_op(), STEPS)
        .new_tree(runner)
        .unwrap()
        .current();
    (config, kinds, ops)
}

/// With a host prefix cache, evicted prefix blocks come back as hits (promotions) while
/// steps fail part-way, in one-group and hybrid models alike.
#[test]
fn host_prefix_hits_happen_under_failures() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut total = Counts::default();
    for case in 0..200 {
        let (config, kinds, ops) = tier_case(&mut runner, case);
        let counts = run(config, &kinds, ops, true);
        total.promotions += counts.promotions;
        total.loads += counts.loads;
        total.failed_loads += counts.failed_loads;
        total.failures += counts.failures;
        total.hit_steps += counts.hit_steps;
    }
    println!("{total:?}");
    assert!(total.promotions > 50 && total.failures > 20, "{total:?}");
}

/// Memory pressure never deadlocks admission with a host prefix tier: after random traffic
/// over a device too small for its prompts (failed moves included), stepping and sampling
/// with nothing new arriving finishes every request, and every load is reported. (Every
/// step's samples are reported, as an engine reports them: a request whose token never comes
/// waits for it by contract.) The tiers take no device block a request would not take without
/// them, and loads end in bounded time, so the scheduler's argument holds unchanged.
#[test]
fn host_prefix_tier_never_deadlocks_admission() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut drained, mut promotions, mut loads, mut failed_loads) = (0, 0, 0, 0);
    for case in 0..100 {
        let (config, kinds, ops) = tier_case(&mut runner, case);
        let mut harness = Harness::new(config, &kinds, true, None, None);
        for op in &ops {
            harness.apply(op);
            // As an engine does: every planned sample is reported before the next step.
            if let Op::Step { .. } = op {
                harness.apply(&Op::Sample { token: 2 });
            }
            harness.check();
        }
        let mut rounds = 0;
        drained += harness.live_requests().len();
        while !harness.live_requests().is_empty() || !harness.loads.is_empty() {
            // Every load is reported in bounded time (a backing that cannot tell times out).
            while !harness.loads.is_empty() {
                harness.apply(&Op::FinishLoad {
                    pick: rounds,
                    ok: rounds % 5 != 0,
                });
            }
            harness.apply(&Op::Step { fail: None });
            harness.apply(&Op::Sample { token: 1 });
            harness.check();
            rounds += 1;
            assert!(
                rounds < 2_000,
                "case {case}: {:?} never finish",
                harness.live_requests()
            );
        }
        promotions += harness.cache.stats().host_prefix.promoted;
        loads += harness.counts.loads;
        failed_loads += harness.counts.failed_loads;
    }
    assert!(
        loads > 50 && failed_loads > 5,
        "{loads} loads, {failed_loads} failed"
    );
    assert!(
        drained > 200 && promotions > 50,
        "{drained} drained, {promotions} promotions"
    );
}
