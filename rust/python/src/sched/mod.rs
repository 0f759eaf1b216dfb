//! Schedulers: continuous batching with its step plan, and the request batcher.

mod continuous;
mod request_batcher;
mod step_plan;

pub use continuous::PyContinuousScheduler;
pub use request_batcher::PyRequestBatcher;
pub use step_plan::PyStepPlan;
