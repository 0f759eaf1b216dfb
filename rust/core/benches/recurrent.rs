//! What recurrent-state groups cost the scheduler's decode step, in the core: a
//! Granite-4.0-H-Tiny-shaped model (40 layers, attention every tenth, 4 KV heads × 128, bf16;
//! Mamba2 states of 1,599,488 bytes per layer) against the same 40 layers all attention, the
//! same decoding batch in both: `cargo bench -p atb-mem-core --bench recurrent`. With prefix
//! caching, states keep checkpoints at the default interval or at every block; without it,
//! none.
//! A step is `step` plus `on_tokens`; its plan's moves are left to a runner, as `step` does.
//! `benches/recurrent_checkpoints.py` measures the same through Python.

use atb_mem_core::{
    AttentionKind, ContinuousScheduler, KvCache, KvCacheConfig, KvCacheDtype, KvDtype, KvLayout,
    LayerKind, Preemption, SchedulerConfig, StepPlan, Tokens,
};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};

const LAYERS: usize = 40;
const BLOCK_SIZE: usize = 16;
const STATE_BYTES: usize = 1_599_488;
const PROMPT: usize = 100;

/// `interval`: `Some(0)` turns prefix caching off (no checkpoints), `None` keeps the default.
fn cache(states: bool, batch: usize, interval: Option<usize>) -> KvCache {
    let kinds: Vec<LayerKind> = (0..LAYERS)
        .map(|layer| match states && layer % 10 != 9 {
            true => LayerKind::Recurrent {
                state_bytes: STATE_BYTES,
            },
            false => LayerKind::Attention(AttentionKind::Full),
        })
        .collect();
    let layout = KvLayout {
        num_layers: LAYERS,
        num_kv_heads: 4,
        head_dim: 128,
        dtype: KvDtype::BFloat16,
        cache_dtype: KvCacheDtype::Auto,
    };
    let probe = KvCacheConfig::new(1 << 20, BLOCK_SIZE, layout)
        .layer_kinds(&kinds)
        .build()
        .unwrap();
    // Room for every sequence's states and the K/V of 640 tokens: the same batch runs.
    let num_blocks = batch * (probe.num_state_blocks() + 40) + 64;
    let caching = interval != Some(0);
    let config = KvCacheConfig {
        state_checkpoint_interval: interval.filter(|&blocks| blocks > 0),
        ..KvCacheConfig::new(num_blocks, BLOCK_SIZE, layout)
            .prefix_caching(caching)
            .layer_kinds(&kinds)
    };
    config.build().unwrap()
}

/// A step and its sampled tokens; `scratch` holds the sampled ids, tokens and finished ids
/// from step to step, so the loop allocates nothing of its own.
fn step(
    scheduler: &mut ContinuousScheduler,
    cache: &mut KvCache,
    plan: &mut StepPlan,
    scratch: &mut (Vec<u64>, Vec<u32>, Vec<u64>),
) {
    scheduler.step(cache, 0, plan).unwrap();
    let (sampled, ones, finished) = scratch;
    sampled.clone_from(&plan.sample_seq_ids);
    ones.resize(sampled.len(), 1);
    finished.clear();
    scheduler
        .on_tokens(cache, sampled, ones, None, finished)
        .unwrap();
}

/// A batch decoding past its prompts' checkpoints.
fn decoding(states: bool, batch: usize, interval: Option<usize>) -> (ContinuousScheduler, KvCache) {
    let mut cache = cache(states, batch, interval);
    let config = SchedulerConfig {
        max_num_seqs: batch,
        max_num_batched_tokens: 8192,
        enable_chunked_prefill: true,
        preemption: Preemption::Recompute,
        watermark: 0.0,
    };
    let mut scheduler = ContinuousScheduler::new(config, &cache).unwrap();
    for seq_id in 0..batch as u64 {
        let ids: Vec<u32> = (seq_id as u32..seq_id as u32 + PROMPT as u32).collect();
        scheduler
            .add_request(&mut cache, seq_id, Tokens::Ids(&ids), 10_000, 1, 0, 0)
            .unwrap();
    }
    let (mut plan, mut scratch) = (StepPlan::default(), Default::default());
    for _ in 0..50 {
        step(&mut scheduler, &mut cache, &mut plan, &mut scratch);
        if plan.decode_seq_ids.len() == batch && plan.moves.is_empty() {
            return (scheduler, cache);
        }
    }
    panic!("the batch never decodes together");
}

fn decode_step(c: &mut Criterion) {
    for batch in [64, 256] {
        let variants = [
            ("attention-only", false, None),
            ("states, checkpoints", true, None),
            ("states, a checkpoint every block", true, Some(1)),
            ("states, no prefix caching", true, Some(0)),
            ("attention-only, no prefix caching", false, Some(0)),
        ];
        for (label, states, interval) in variants {
            let state = decoding(states, batch, interval);
            let name = format!("recurrent/decode step, {batch} running, {label}");
            // A run of steps starts from a copy of the same state; only the steps are timed.
            c.bench_function(&name, |b| {
                b.iter_custom(|iters| {
                    let mut timed = Duration::ZERO;
                    let mut left = iters;
                    while left > 0 {
                        let (mut scheduler, mut cache) = state.clone();
                        let mut plan = StepPlan::default();
                        let mut scratch = Default::default();
                        let steps = left.min(256);
                        let start = Instant::now();
                        for _ in 0..steps {
                            step(&mut scheduler, &mut cache, &mut plan, &mut scratch);
                        }
                        timed += start.elapsed();
                        left -= steps;
                    }
                    timed
                })
            });
        }
    }
}

criterion_group!(
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = decode_step
);
criterion_main!(benches);
