//! The scheduler-step workloads `benches/step.rs` times and `examples/step_cost.rs` counts
//! instructions of: a batch decoding, its prompts as counts or token ids, after a fork, or
//! with `hash_block_size = 4` and one request waiting.

use atb_mem_core::{
    ContinuousScheduler, KvCache, KvCacheConfig, KvLayout, Preemption, SchedulerConfig, StepPlan,
    Tokens,
};

const BLOCK_SIZE: usize = 16;
const PROMPT: usize = 200;

#[derive(Clone, Copy, PartialEq)]
pub enum Variant {
    Counts,
    Ids,
    AfterFork,
    SubBlocks,
}

/// A step and its sampled tokens, the buffers reused from step to step. `executing`: the
/// step executes its moves itself (`step_executing`), and so can roll back.
pub fn step(
    scheduler: &mut ContinuousScheduler,
    cache: &mut KvCache,
    plan: &mut StepPlan,
    scratch: &mut (Vec<u64>, Vec<u32>, Vec<u64>),
    executing: bool,
) {
    match executing {
        true => scheduler
            .step_executing(cache, 0, plan, |_| Ok(()))
            .unwrap(),
        false => scheduler.step(cache, 0, plan).unwrap(),
    }
    let (sampled, tokens, finished) = scratch;
    sampled.clone_from(&plan.sample_seq_ids);
    tokens.clear();
    tokens.extend(sampled.iter().map(|&id| (id % 1000) as u32));
    finished.clear();
    scheduler
        .on_tokens(cache, sampled, tokens, None, finished)
        .unwrap();
}

/// Serves one request of two samples to its end, its fork included.
fn run_forked_request(scheduler: &mut ContinuousScheduler, cache: &mut KvCache, seq_id: u64) {
    scheduler
        .add_request(cache, seq_id, Tokens::Count(2 * BLOCK_SIZE + 1), 3, 2, 0, 0)
        .unwrap();
    let (child, mut plan) = (seq_id + 1, StepPlan::default());
    let mut live = vec![seq_id];
    for _ in 0..16 {
        scheduler.step(cache, 0, &mut plan).unwrap();
        let mut sampled: Vec<u64> = plan
            .sample_seq_ids
            .iter()
            .copied()
            .filter(|id| live.contains(id))
            .collect();
        if sampled.contains(&seq_id) && !live.contains(&child) {
            scheduler.fork(cache, seq_id, child).unwrap();
            live.push(child);
            sampled.push(child);
        }
        let mut finished = Vec::new();
        let ones = vec![1; sampled.len()];
        scheduler
            .on_tokens(cache, &sampled, &ones, None, &mut finished)
            .unwrap();
        live.retain(|id| !finished.contains(id));
        if live.is_empty() {
            return;
        }
    }
    panic!("the forked request never ended");
}

pub fn decoding(running: usize, variant: Variant) -> (ContinuousScheduler, KvCache) {
    let num_blocks = running * (PROMPT / BLOCK_SIZE + 40) + 256;
    let mut config = KvCacheConfig::new(num_blocks, BLOCK_SIZE, KvLayout::default());
    if variant == Variant::SubBlocks {
        config = config.hash_block_size(4);
    }
    let mut cache = config.build().unwrap();
    let config = SchedulerConfig {
        max_num_seqs: running,
        max_num_batched_tokens: 8192,
        enable_chunked_prefill: true,
        preemption: Preemption::Recompute,
        watermark: 0.0,
    };
    let mut scheduler = ContinuousScheduler::new(config, &cache).unwrap();
    if variant == Variant::AfterFork {
        run_forked_request(&mut scheduler, &mut cache, running as u64 + 1);
    }
    for seq_id in 0..running as u64 {
        let ids: Vec<u32> = (0..PROMPT as u32)
            .map(|t| (seq_id as u32 * 7919 + t) % 32000)
            .collect();
        let prompt = match variant {
            Variant::Counts | Variant::AfterFork => Tokens::Count(PROMPT),
            Variant::Ids | Variant::SubBlocks => Tokens::Ids(&ids),
        };
        scheduler
            .add_request(&mut cache, seq_id, prompt, 100_000, 1, 0, 0)
            .unwrap();
    }
    if variant == Variant::SubBlocks {
        let waiting: Vec<u32> = (0..3 * BLOCK_SIZE as u32).collect();
        scheduler
            .add_request(
                &mut cache,
                running as u64 + 10,
                Tokens::Ids(&waiting),
                100,
                1,
                0,
                0,
            )
            .unwrap();
    }
    let (mut plan, mut scratch) = (StepPlan::default(), Default::default());
    for _ in 0..running {
        step(&mut scheduler, &mut cache, &mut plan, &mut scratch, false);
        if plan.decode_seq_ids.len() == running {
            return (scheduler, cache);
        }
    }
    panic!("the batch never decodes together");
}
