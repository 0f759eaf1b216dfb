//! `KVCachePool(...)`: its arguments, converted and checked one by one, fill the
//! `KvCacheConfig` the core builds the cache from.

use atb_mem_core::{
    layer_kinds, EvictionPolicy, KvCache, KvCacheConfig, KvCacheDtype, KvDtype, KvLayout,
};
use pyo3::prelude::*;

use super::PyKvCachePool;
use crate::convert::{count, Dtype, LayerTypes};
use crate::errors::IntoPyResult;
use crate::lock::PyLock;

#[pymethods]
impl PyKvCachePool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, num_layers=None, num_kv_heads=None, head_dim=None,
                        dtype=None, enable_prefix_caching=true, num_host_blocks=None,
                        host_prefix_cache=false, enable_kv_events=false, layer_types=None,
                        sliding_window=None, attention_chunk_size=None, eviction_policy=None,
                        hash_block_size=None, state_bytes=None,
                        state_checkpoint_interval=None, kv_cache_dtype=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        #[pyo3(from_py_with = arg::num_blocks)] num_blocks: usize,
        #[pyo3(from_py_with = arg::block_size)] block_size: usize,
        #[pyo3(from_py_with = arg::num_layers)] num_layers: Option<usize>,
        #[pyo3(from_py_with = arg::num_kv_heads)] num_kv_heads: Option<usize>,
        #[pyo3(from_py_with = arg::head_dim)] head_dim: Option<usize>,
        dtype: Option<Dtype>,
        enable_prefix_caching: bool,
        #[pyo3(from_py_with = arg::num_host_blocks)] num_host_blocks: Option<usize>,
        host_prefix_cache: bool,
        enable_kv_events: bool,
        layer_types: Option<LayerTypes>,
        #[pyo3(from_py_with = arg::sliding_window)] sliding_window: Option<usize>,
        #[pyo3(from_py_with = arg::attention_chunk_size)] attention_chunk_size: Option<usize>,
        eviction_policy: Option<String>,
        #[pyo3(from_py_with = arg::hash_block_size)] hash_block_size: Option<usize>,
        #[pyo3(from_py_with = arg::state_bytes)] state_bytes: Option<usize>,
        #[pyo3(from_py_with = arg::interval)] state_checkpoint_interval: Option<usize>,
        kv_cache_dtype: Option<String>,
    ) -> PyResult<Self> {
        let mut layout = layout(num_layers, num_kv_heads, head_dim, dtype);
        if let Some(name) = kv_cache_dtype {
            layout.cache_dtype = KvCacheDtype::parse(&name).into_py_result()?;
        }
        let kinds = layer_kinds(
            layout.num_layers,
            layer_types.as_ref().map(|names| names.0.as_slice()),
            sliding_window,
            attention_chunk_size,
            state_bytes,
        )
        .into_py_result()?;
        let config = KvCacheConfig {
            num_blocks,
            block_size,
            layout,
            enable_prefix_caching,
            layer_kinds: Some(kinds),
            eviction_policy: match eviction_policy {
                None => EvictionPolicy::default(),
                Some(name) => name.parse().into_py_result()?,
            },
            hash_block_size,
            state_checkpoint_interval,
            num_host_blocks,
            host_prefix_cache,
            enable_kv_events,
        };
        let cache = KvCache::from_config(&config).into_py_result()?;
        Ok(PyKvCachePool {
            cache: PyLock::new(cache),
        })
    }
}

/// The layout of `KVCachePool(...)`'s shape arguments; each defaults to one (float16).
fn layout(
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
        cache_dtype: KvCacheDtype::Auto,
    }
}

/// `#[pyo3(from_py_with = ...)]` converters of `KVCachePool(...)`'s counts whose errors name
/// the argument and its unit (PyO3 names the argument of a `TypeError` only); the optional
/// ones take `None` as not given.
mod arg {
    use pyo3::prelude::*;

    use super::count;

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
}
