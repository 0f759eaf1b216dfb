//! Building a `KVCachePool`'s core from its converted arguments.

use atb_mem_core::{layer_kinds, EvictionPolicy, KvCache, KvCacheConfig, KvDtype, KvLayout};
use pyo3::prelude::*;

use crate::convert::{count, Dtype};
use crate::errors::IntoPyResult;

/// `#[pyo3(from_py_with = ...)]` converters of `KVCachePool(...)`'s counts whose errors name
/// the argument and its unit (PyO3 names the argument of a `TypeError` only); the optional
/// ones take `None` as not given.
macro_rules! named_counts {
    ($($argument:ident: $type:ty = $what:literal >= $minimum:literal;)+) => {$(
        pub(super) fn $argument(obj: &Bound<'_, PyAny>) -> PyResult<$type> {
            named_count(obj, $what, $minimum)
        }
    )+};
}

trait FromCount: Sized {
    fn none() -> Option<Self>;
    fn some(value: usize) -> Self;
}

impl FromCount for usize {
    fn none() -> Option<Self> {
        None
    }
    fn some(value: usize) -> Self {
        value
    }
}

impl FromCount for Option<usize> {
    fn none() -> Option<Self> {
        Some(None)
    }
    fn some(value: usize) -> Self {
        Some(value)
    }
}

fn named_count<T: FromCount>(obj: &Bound<'_, PyAny>, what: &str, minimum: i64) -> PyResult<T> {
    match T::none() {
        Some(none) if obj.is_none() => Ok(none),
        _ => count(obj, what, minimum).map(T::some),
    }
}

named_counts! {
    num_blocks: usize = "num_blocks (blocks, with the null block 0)" >= 2;
    block_size: usize = "block_size (tokens)" >= 1;
    num_layers: Option<usize> = "num_layers" >= 1;
    num_kv_heads: Option<usize> = "num_kv_heads" >= 1;
    head_dim: Option<usize> = "head_dim (values per head)" >= 1;
    num_host_blocks: Option<usize> = "num_host_blocks (blocks)" >= 1;
    sliding_window: Option<usize> = "sliding_window (tokens)" >= 1;
    attention_chunk_size: Option<usize> = "attention_chunk_size (tokens)" >= 1;
    hash_block_size: Option<usize> = "hash_block_size (tokens)" >= 1;
    state_bytes: Option<usize> = "state_bytes (bytes)" >= 1;
    interval: Option<usize> = "state_checkpoint_interval (blocks)" >= 1;
}

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

/// The layout of `KVCachePool(...)`'s shape arguments; each defaults to one (float16).
pub(super) fn layout(
    num_layers: Option<usize>,
    num_kv_heads: Option<usize>,
    head_dim: Option<usize>,
    dtype: Option<Dtype>,
) -> KvLayout {
    KvLayout {
        num_layers: num_layers.unwrap_or(1),
        num_kv_heads: num_kv_heads.unwrap_or(1),
        head_dim: head_dim.unwrap_or(1),
        dtype: dtype.map_or(KvDtype::Float16, |dtype| dtype.0),
    }
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
    let config = KvCacheConfig {
        num_blocks: args.num_blocks,
        block_size: args.block_size,
        layout: args.layout,
        enable_prefix_caching: args.enable_prefix_caching,
        layer_kinds: Some(kinds),
        eviction_policy: policy,
        hash_block_size: args.hash_block_size,
        state_checkpoint_interval: args.state_checkpoint_interval,
        num_host_blocks: args.num_host_blocks,
        host_prefix_cache: args.host_prefix_cache,
        enable_kv_events: args.enable_kv_events,
    };
    KvCache::from_config(&config).into_py_result()
}
