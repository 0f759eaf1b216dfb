//! Python bindings of atb-mem: argument conversion, locking and error mapping around the
//! Rust core. No policy lives here: every transaction (plan, execute, commit or roll back) is
//! the core's, given Python's byte executor as a closure. The folders mirror the core's:
//! `alloc` (MemPool), `kv_cache` (the cache, its batch table, its events, host byte copies,
//! the executor), `sched` (the continuous scheduler, its step plan, the request batcher).

mod alloc;
mod attention;
mod content_digest;
mod convert;
mod errors;
mod kv_cache;
mod layout;
mod linear;
mod lock;
mod quant;
mod sched;

use pyo3::prelude::*;
use pyo3::types::PyTuple;

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(module)?;
    module.add_class::<kv_cache::PyKvCachePool>()?;
    module.add_class::<kv_cache::PyBatchTable>()?;
    module.add_class::<kv_cache::PyKvEventList>()?;
    module.add_class::<alloc::PyMemPool>()?;
    module.add_class::<alloc::PyAllocation>()?;
    module.add_class::<alloc::HostRegion>()?;
    module.add_class::<sched::PyRequestBatcher>()?;
    module.add_class::<sched::PyContinuousScheduler>()?;
    module.add_class::<sched::PyStepPlan>()?;
    module.add_function(wrap_pyfunction!(kv_cache::host_copy::scatter_rows, module)?)?;
    module.add_function(wrap_pyfunction!(kv_cache::host_copy::copy_blocks, module)?)?;
    module.add_function(wrap_pyfunction!(layout::kv_layout_bytes, module)?)?;
    module.add_function(wrap_pyfunction!(content_digest::content_digests, module)?)?;
    module.add_function(wrap_pyfunction!(attention::paged_attention, module)?)?;
    module.add_function(wrap_pyfunction!(attention::use_openmp, module)?)?;
    module.add_function(wrap_pyfunction!(linear::linear, module)?)?;
    module.add_function(wrap_pyfunction!(layout::kv_cache_groups, module)?)?;
    module.add_function(wrap_pyfunction!(quant::quantize_kv_rows, module)?)?;
    module.add_function(wrap_pyfunction!(quant::dequantize_kv_rows, module)?)?;
    module.add("KV_DTYPES", layout::dtype_names())?;
    module.add("KV_CACHE_DTYPES", layout::kv_cache_dtype_names())?;
    let policies = PyTuple::new(module.py(), atb_mem_core::EvictionPolicy::NAMES)?;
    module.add("EVICTION_POLICIES", policies)?;
    module.add("NULL_BLOCK", atb_mem_core::NULL_BLOCK)?;
    module.add("PAD_SLOT", atb_mem_core::PAD_SLOT)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
