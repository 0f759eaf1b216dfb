//! Byte sizes of a K/V layout, from the core: the one place they are computed.

use atb_mem_core::{group_hybrid_layers, layer_kinds, KvCacheDtype, KvDtype, KvLayout};
use pyo3::prelude::*;

use crate::convert::{Count, Dtype, LayerTypes};
use crate::errors::{value_error, IntoPyResult};

/// (itemsize, bytes per token, bytes per block) of K plus V over every layer; a quantized
/// cache's rows count their scales.
#[pyfunction]
#[pyo3(signature = (num_layers, num_kv_heads, head_dim, dtype, block_size, kv_cache_dtype="auto"))]
pub fn kv_layout_bytes(
    num_layers: Count<1>,
    num_kv_heads: Count<1>,
    head_dim: Count<1>,
    dtype: Dtype,
    block_size: Count<1>,
    kv_cache_dtype: &str,
) -> PyResult<(usize, usize, usize)> {
    let num_layers = num_layers.0;
    let num_kv_heads = num_kv_heads.0;
    let head_dim = head_dim.0;
    let dtype = dtype.0;
    let block_size = block_size.0;
    let layout = KvLayout {
        num_layers,
        num_kv_heads,
        head_dim,
        dtype,
        cache_dtype: KvCacheDtype::parse(kv_cache_dtype).into_py_result()?,
    };
    layout.validate().into_py_result()?;
    let overflow = || value_error("the K/V size overflows 64 bits");
    // What the cache stores: one-byte codes where it quantizes.
    let itemsize = match layout.cache_dtype {
        KvCacheDtype::Auto => dtype.itemsize(),
        _ => 1,
    };
    Ok((
        itemsize,
        layout.bytes_per_token().ok_or_else(overflow)?,
        layout.bytes_per_block(block_size).ok_or_else(overflow)?,
    ))
}

/// The KV-cache groups a model's layers form, as `KVCachePool` would make them:
/// (`[(kind, layers, window)]`, layers per block, `[(layers, state bytes)]` of the recurrent
/// layers' state groups).
#[pyfunction]
#[pyo3(signature = (num_layers, layer_types=None, sliding_window=None, attention_chunk_size=None,
                    state_bytes=None))]
pub fn kv_cache_groups(
    num_layers: Count<1>,
    layer_types: Option<LayerTypes>,
    sliding_window: Option<Count<1>>,
    attention_chunk_size: Option<Count<1>>,
    state_bytes: Option<Count<1>>,
) -> PyResult<GroupsRow> {
    let kinds = layer_kinds(
        num_layers.0,
        layer_types.as_ref().map(|names| names.0.as_slice()),
        sliding_window.map(Count::get),
        attention_chunk_size.map(Count::get),
        state_bytes.map(Count::get),
    )
    .into_py_result()?;
    let groups = group_hybrid_layers(&kinds).into_py_result()?;
    let rows = groups
        .attention
        .iter()
        .map(|g| (g.kind.name(), g.layers.clone(), g.kind.span()));
    let states = groups
        .recurrent
        .into_iter()
        .map(|(bytes, layers)| (layers, bytes));
    Ok((rows.collect(), groups.layers_per_block, states.collect()))
}

type GroupsRow = (
    Vec<crate::kv_cache::GroupRow>,
    usize,
    Vec<(Vec<usize>, usize)>,
);

/// The `kv_cache_dtype` names a K/V cache accepts.
pub fn kv_cache_dtype_names() -> Vec<&'static str> {
    KvCacheDtype::ALL.iter().map(|dtype| dtype.name()).collect()
}

/// The dtype names a K/V cache accepts, canonical spelling.
pub fn dtype_names() -> Vec<&'static str> {
    KvDtype::ALL.iter().map(|dtype| dtype.name()).collect()
}
