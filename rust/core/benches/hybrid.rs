//! A Gemma-3-shaped model (32 layers, 5 sliding 1024 : 1 full, 8 KV heads × 128, bf16) at 30k
//! context: the scheduler's decode step and a prefix lookup with KV-cache groups (7 groups)
//! against a cache of one group that keeps every block, the same sequences in both:
//! `cargo bench -p atb-mem-core --bench hybrid`.
//!
//! A decode step is `step` (plan, block tables, slot mappings) plus `on_tokens` for 10
//! sequences: with every block they do not hold cached (allocations evict, as on a busy
//! server), and with the free blocks uncached but for those windows released. The lookup is `blocks_to_allocate` on a cached 32k prompt (its hashing
//! included).

use atb_mem_core::{
    AttentionKind, ContinuousScheduler, KvCache, KvCacheConfig, KvCacheDtype, KvDtype, KvLayout,
    Preemption, SchedulerConfig, StepPlan, Tokens,
};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};

const LAYERS: usize = 32;
const BLOCK_SIZE: usize = 16;
const SEQUENCES: u64 = 10;
const PROMPT: usize = 30 * 1024;

fn layout() -> KvLayout {
    KvLayout {
        num_layers: LAYERS,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: KvDtype::BFloat16,
        cache_dtype: KvCacheDtype::Auto,
    }
}

fn cache(grouped: bool) -> KvCache {
    let sliding = AttentionKind::SlidingWindow { window: 1024 };
    let kinds: Vec<AttentionKind> = (0..LAYERS)
        .map(|layer| match (grouped, (layer + 1) % 6 == 0) {
            (true, false) => sliding,
            _ => AttentionKind::Full,
        })
        .collect();
    KvCacheConfig::new(40_000, BLOCK_SIZE, layout())
        .layer_kinds(&kinds)
        .build()
        .unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|t| t.wrapping_mul(2_654_435_761).wrapping_add(seed) % 32_000)
        .collect()
}

/// One step and its tokens; the block tables written as a runner's buffer would be.
fn decode(
    scheduler: &mut ContinuousScheduler,
    cache: &mut KvCache,
    plan: &mut StepPlan,
    cells: &mut [i32],
) {
    scheduler.step(cache, 0, plan).unwrap();
    scheduler
        .write_block_tables(cache, plan, cells, 2048 + 256, false)
        .unwrap();
    let ids = plan.sample_seq_ids.clone();
    let tokens = vec![1; ids.len()];
    scheduler
        .on_tokens(cache, &ids, &tokens, None, &mut Vec::new())
        .unwrap();
}

/// 10 sequences past their prefill, decoding; with `busy`, every block they do not hold
/// holds cached contents (allocations evict), else only the blocks windows released do.
fn decoding(grouped: bool, busy: bool) -> (ContinuousScheduler, KvCache, Vec<i32>) {
    let mut cache = cache(grouped);
    let config = SchedulerConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: 8192,
        enable_chunked_prefill: true,
        preemption: Preemption::Recompute,
        watermark: 0.0,
    };
    let mut scheduler = ContinuousScheduler::new(config, &cache).unwrap();
    for seq_id in 0..SEQUENCES {
        let ids = prompt(seq_id as u32, PROMPT);
        scheduler
            .add_request(&mut cache, seq_id, Tokens::Ids(&ids), 8192, 1, 0, 0)
            .unwrap();
    }
    let mut plan = StepPlan::default();
    let mut cells = vec![0; cache.num_groups() * 16 * (2048 + 256)];
    for _ in 0..200 {
        decode(&mut scheduler, &mut cache, &mut plan, &mut cells);
    }
    assert_eq!(plan.decode_seq_ids.len(), SEQUENCES as usize);
    if busy {
        fill_with_cached_blocks(&mut cache);
    }
    (scheduler, cache, cells)
}

/// A busy server's cache: every block not in use holds cached contents (finished requests'),
/// so allocations evict, in both caches alike.
fn fill_with_cached_blocks(cache: &mut KvCache) {
    let mut seq_id = 1 << 32;
    while cache.block_pool().num_free() > cache.block_pool().num_evictable() + 64 {
        let ids = prompt(seq_id as u32, 64 * BLOCK_SIZE);
        cache
            .alloc_sequence(seq_id, Tokens::Ids(&ids), None)
            .unwrap();
        cache.mark_computed(seq_id, Some(ids.len())).unwrap();
        cache.free_sequence(seq_id).unwrap();
        seq_id += 1;
    }
}

fn decode_step(c: &mut Criterion) {
    for (busy, grouped) in [(true, false), (true, true), (false, false), (false, true)] {
        let state = decoding(grouped, busy);
        let name = format!(
            "hybrid/decode step, 10 seqs at 30k, {}, {}",
            if grouped { "7 groups" } else { "one group" },
            if busy {
                "every allocation evicts"
            } else {
                "free blocks uncached"
            }
        );
        // Each iteration is one step; a run of steps starts from a copy of the same state
        // (the sequences would otherwise finish), and only the steps are timed.
        c.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let (mut scheduler, mut cache, mut cells) = state.clone();
                    let mut plan = StepPlan::default();
                    let steps = left.min(4096);
                    let start = Instant::now();
                    for _ in 0..steps {
                        decode(&mut scheduler, &mut cache, &mut plan, &mut cells);
                    }
                    timed += start.elapsed();
                    left -= steps;
                }
                timed
            })
        });
    }
}

fn prefix_lookup(c: &mut Criterion) {
    for grouped in [false, true] {
        let mut cache = cache(grouped);
        let ids = prompt(99, 32 * 1024);
        cache.alloc_sequence(1, Tokens::Ids(&ids), None).unwrap();
        cache.mark_computed(1, Some(ids.len())).unwrap();
        let hit = cache.blocks_to_allocate(Tokens::Ids(&ids), None).unwrap();
        assert_eq!(hit, cache.num_groups(), "all but the last block is a hit");
        let name = match grouped {
            true => "hybrid/prefix lookup, 32k cached, 7 groups",
            false => "hybrid/prefix lookup, 32k cached, one group",
        };
        c.bench_function(name, |b| {
            b.iter(|| cache.blocks_to_allocate(Tokens::Ids(&ids), None).unwrap())
        });
    }
}

criterion_group!(
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = decode_step, prefix_lookup
);
criterion_main!(benches);
