//! Python bindings of atb-mem: argument conversion, locking and error mapping around the
//! Rust core. No policy lives here.

mod convert;
mod errors;
mod host_copy;
mod kv_cache;
mod lock;
mod mem_pool;
mod request_batcher;
mod scheduler;
mod step_plan;
mod transfer;

use pyo3::prelude::*;

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(module)?;
    module.add_class::<kv_cache::PyKvCachePool>()?;
    module.add_class::<kv_cache::PyBatchTable>()?;
    module.add_class::<mem_pool::PyMemPool>()?;
    module.add_class::<mem_pool::PyAllocation>()?;
    module.add_class::<mem_pool::HostRegion>()?;
    module.add_class::<request_batcher::PyRequestBatcher>()?;
    module.add_class::<scheduler::PyContinuousScheduler>()?;
    module.add_class::<step_plan::PyStepPlan>()?;
    module.add_function(wrap_pyfunction!(host_copy::scatter_rows, module)?)?;
    module.add_function(wrap_pyfunction!(host_copy::copy_blocks, module)?)?;
    module.add("NULL_BLOCK", atb_mem_core::NULL_BLOCK)?;
    module.add("PAD_SLOT", atb_mem_core::PAD_SLOT)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
