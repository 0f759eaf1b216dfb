//! Faults in the scheduler model: what survives a failed step, and a cache changed behind
//! the scheduler's back.

use atb_mem_core::{ContinuousScheduler, KvCache, StepPlan, Tokens};

use super::state::state;
use super::Harness;

impl Harness {
    /// After a failed step, every request that was not ended is where it was before it:
    /// same progress, same tier, same blocks.
    pub(super) fn check_survivors(&self, before: &(ContinuousScheduler, KvCache), aborted: &[u64]) {
        let (scheduler, cache) = before;
        for seq_id in cache.seq_ids().filter(|id| !aborted.contains(id)) {
            assert_eq!(
                self.cache.seq_len_and_tier(seq_id).ok(),
                cache.seq_len_and_tier(seq_id).ok()
            );
            for group in 0..cache.num_groups() {
                assert_eq!(
                    self.cache.group_block_table(seq_id, group).ok(),
                    cache.group_block_table(seq_id, group).ok(),
                    "sequence {seq_id}, group {group}"
                );
            }
            assert_eq!(
                self.scheduler.progress(seq_id).ok(),
                scheduler.progress(seq_id).ok()
            );
        }
    }

    /// Changes the cache behind the scheduler's back, on copies: the step must then fail
    /// and change nothing. `how`: free a request's sequence, swap it to the other tier, or
    /// allocate a waiting request's id.
    pub(super) fn tamper(&mut self, pick: usize, how: usize) {
        let live = self.live_requests();
        let Some(&seq_id) = live.get(pick % live.len().max(1)) else {
            return;
        };
        let (mut scheduler, mut cache) = (self.scheduler.clone(), self.cache.clone());
        let on_cache = cache.contains(seq_id);
        let tampered = match (how % 3, on_cache) {
            (0, true) => cache.free_sequence(seq_id).is_ok(),
            (1, true) => match cache.is_swapped(seq_id).unwrap() {
                true => cache.swap_in(&[seq_id]).is_ok(),
                false => cache.swap_out(&[seq_id]).is_ok(),
            },
            (2, false) => cache.alloc_sequence(seq_id, Tokens::Count(1), None).is_ok(),
            _ => false,
        };
        if !tampered {
            return;
        }
        let before = state(&scheduler, &cache);
        let mut plan = StepPlan::default();
        let result = scheduler.step(&mut cache, 0, &mut plan);
        // A waiting request only counts once a step may admit it.
        match (result, on_cache) {
            (Err(_), _) => self.counts.tampered_steps += 1,
            (Ok(()), true) => panic!("a step over a tampered cache ({how}, {seq_id}) passed"),
            (Ok(()), false) => return,
        }
        assert_eq!(
            state(&scheduler, &cache),
            before,
            "tampered {how}, {seq_id}"
        );
    }
}

impl Harness {
    /// What the last step planned, for `ATB_MEM_TRACE=1`.
    pub(super) fn trace(&self) {
        let plan = &self.plan;
        eprintln!(
            "  plan {:?} {:?} q{:?} moves {:?} pre {:?}",
            plan.prefill_seq_ids,
            plan.decode_seq_ids,
            plan.query_lens,
            plan.moves,
            plan.preempted_seq_ids
        );
        for id in plan.prefill_seq_ids.iter().chain(&plan.decode_seq_ids) {
            let tables: Vec<_> = (0..self.cache.num_groups())
                .map(|g| {
                    let table = self.cache.group_block_table(*id, g);
                    table.ok().map(<[u32]>::to_vec)
                })
                .collect();
            let state = self.cache.state_blocks(*id).ok();
            eprintln!(
                "  {id}: {tables:?} state {state:?} slots {:?}",
                plan.slot_mapping
            );
        }
    }
}

/// An aborted request's blocks are freed at the next step's start; a prefill short of free
/// blocks then evicts (and demotes) them, so that step needs its snapshot. It was not
/// foreseen when no running request had token ids of its own.
#[test]
fn a_deferred_free_is_foreseen_as_an_eviction() {
    use super::workload::Op;
    use atb_mem_core::{AttentionKind, Preemption, SchedulerConfig};

    let config = SchedulerConfig {
        max_num_seqs: 2,
        max_num_batched_tokens: 64,
        enable_chunked_prefill: false,
        preemption: Preemption::Recompute,
        watermark: 0.0,
    };
    let kinds = (vec![AttentionKind::SlidingWindow { window: 2 }], 1);
    let add = |keep, tail, by_count| Op::Add {
        template: 0,
        keep,
        tail,
        by_count,
        max_new: 1,
        samples: 1,
    };
    let ops = vec![
        add(5, vec![0; 6], false),
        add(3, vec![0], true),
        Op::Step { fail: None },
        Op::Abort { pick: 2 },
        Op::Step { fail: None },
    ];
    let counts = super::run(config, &kinds, ops, true);
    assert!(
        counts.swaps > 0,
        "the second step demotes the aborted request's blocks"
    );
}
