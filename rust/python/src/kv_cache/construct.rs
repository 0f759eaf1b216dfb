//! Building a `KVCachePool`'s core from its converted arguments.

use atb_mem_core::{layer_kinds, EvictionPolicy, KvCache, KvLayout};
use pyo3::prelude::*;

use crate::errors::IntoPyResult;

/// `KVCachePool(...)`'s arguments, converted and checked one by one.
pub(super) struct CacheArgs {
    pub num_blocks: usize,
    pub block_size: usize,
    pub layout: KvLayout,
    pub enable_prefix_caching: bool,
    pub num_host_blocks: Option<usize>,
    pub host_prefix_cache: bool,
    pub enable_kv_events: bool,
    pub layer_types: Option<Vec<String>>,
    pub sliding_window: Option<usize>,
    pub attention_chunk_size: Option<usize>,
    pub eviction_policy: Option<String>,
    pub hash_block_size: Option<usize>,
    /// Bytes of one recurrent layer's state (`"linear_attention"` layers).
    pub state_bytes: Option<usize>,
    /// Blocks between two checkpoints of a sequence's recurrent states.
    pub state_checkpoint_interval: Option<usize>,
}

pub(super) fn build(args: CacheArgs) -> PyResult<KvCache> {
    let policy = match args.eviction_policy.as_deref() {
        None => EvictionPolicy::default(),
        Some(name) => EvictionPolicy::from_name(name).ok_or_else(|| {
            crate::errors::value_error(format!(
                "unknown eviction_policy '{name}': one of {}",
                EvictionPolicy::ALL.map(EvictionPolicy::name).join(", ")
            ))
        })?,
    };
    let kinds = layer_kinds(
        args.layout.num_layers,
        args.layer_types.as_deref(),
        args.sliding_window,
        args.attention_chunk_size,
        args.state_bytes,
    )
    .into_py_result()?;
    // Built with its policy, not rebuilt: replacing the block pool after the fact placed its
    // arrays apart from the rest, and cost the decode step a quarter (benches/ab_compare.py).
    let mut cache = KvCache::with_policy(
        args.num_blocks,
        args.block_size,
        args.layout,
        args.enable_prefix_caching,
        &kinds,
        policy,
    )
    .into_py_result()?;
    if let Some(hash_block_size) = args.hash_block_size {
        cache
            .set_hash_block_size(hash_block_size)
            .into_py_result()?;
    }
    if let Some(interval) = args.state_checkpoint_interval {
        cache
            .set_state_checkpoint_interval(interval)
            .into_py_result()?;
    }
    if let Some(num_host_blocks) = args.num_host_blocks {
        cache.enable_host_tier(num_host_blocks).into_py_result()?;
    }
    if args.host_prefix_cache {
        cache.enable_host_prefix_cache().into_py_result()?;
    }
    if args.enable_kv_events {
        cache.enable_kv_events().into_py_result()?;
    }
    Ok(cache)
}
