//! A continuous scheduler over a cache, with chunked prefill and recompute preemption: the
//! setting the directed scheduler tests share.

use atb_mem_core::{ContinuousScheduler, KvCache, Preemption, SchedulerConfig};

pub fn scheduler(
    cache: &KvCache,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    watermark: f64,
) -> ContinuousScheduler {
    let config = SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens,
        enable_chunked_prefill: true,
        preemption: Preemption::Recompute,
        watermark,
    };
    ContinuousScheduler::new(config, cache).unwrap()
}
