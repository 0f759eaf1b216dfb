//! `RequestBatcher`: the request-batching policy of `DynamicBatchScheduler` (convert, lock,
//! call the core, map errors). Time comes in as an argument, in nanoseconds.

use std::sync::{Mutex, MutexGuard};

use atb_mem_core::{BatcherConfig, RequestBatcher, TimeoutAction};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{self, Count, Nanos, SeqId};
use crate::errors::{value_error, IntoPyResult};
use crate::lock::lock;

fn ns(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<u64>> {
    match obj.filter(|obj| !obj.is_none()) {
        Some(obj) => Ok(Some(convert::count(obj, what, 0)? as u64)),
        None => Ok(None),
    }
}

fn config_dict<'py>(py: Python<'py>, config: &BatcherConfig) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("max_batch_size", config.max_batch_size)?;
    dict.set_item("timeout_ns", config.timeout_ns)?;
    dict.set_item(
        "preferred_batch_sizes",
        config.preferred_batch_sizes.clone(),
    )?;
    dict.set_item("max_queue_size", config.max_queue_size)?;
    dict.set_item("priority_levels", config.priority_levels)?;
    dict.set_item("default_timeout_ns", config.default_timeout_ns)?;
    dict.set_item("timeout_action", config.timeout_action.name())?;
    Ok(dict)
}

/// Deterministic request-batching policy: queues per priority, releases a batch at
/// `max_batch_size`, at a preferred size, or when the oldest request waited `timeout_ns`.
#[pyclass(frozen, name = "RequestBatcher", module = "atb_mem._core")]
pub struct PyRequestBatcher {
    batcher: Mutex<RequestBatcher>,
}

impl PyRequestBatcher {
    fn lock(&self) -> MutexGuard<'_, RequestBatcher> {
        lock(&self.batcher)
    }
}

/// A configuration: a dict with the keys `config()` returns, every one and nothing else.
pub struct BatcherConfigArg(BatcherConfig);

impl<'a, 'py> FromPyObject<'a, 'py> for BatcherConfigArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        build_config(&obj).map(BatcherConfigArg)
    }
}

fn build_config(config: &Bound<'_, PyAny>) -> PyResult<BatcherConfig> {
    let [max_batch_size, timeout_ns, preferred, max_queue_size, priority_levels, default_timeout_ns, action] =
        convert::config_items(
            config,
            [
                "max_batch_size",
                "timeout_ns",
                "preferred_batch_sizes",
                "max_queue_size",
                "priority_levels",
                "default_timeout_ns",
                "timeout_action",
            ],
        )?;
    let mut preferred = preferred
        .try_iter()?
        .map(|size| convert::count(&size?, "preferred_batch_sizes entries", 1))
        .collect::<PyResult<Vec<_>>>()?;
    preferred.sort_unstable();
    preferred.dedup();
    Ok(BatcherConfig {
        max_batch_size: convert::count(&max_batch_size, "max_batch_size", 1)?,
        timeout_ns: convert::count(&timeout_ns, "timeout_ns", 0)? as u64,
        preferred_batch_sizes: preferred,
        max_queue_size: match Some(&max_queue_size).filter(|limit| !limit.is_none()) {
            Some(limit) => Some(convert::count(limit, "max_queue_size", 1)?),
            None => None,
        },
        priority_levels: convert::count(&priority_levels, "priority_levels", 1)?,
        default_timeout_ns: ns(Some(&default_timeout_ns), "default_timeout_ns")?,
        timeout_action: TimeoutAction::parse(
            action
                .extract::<&str>()
                .map_err(|_| value_error("timeout_action must be \"reject\" or \"delay\""))?,
        )
        .into_py_result()?,
    })
}

#[pymethods]
impl PyRequestBatcher {
    #[new]
    fn new(config: BatcherConfigArg) -> PyResult<Self> {
        Ok(PyRequestBatcher {
            batcher: Mutex::new(RequestBatcher::new(config.0).into_py_result()?),
        })
    }

    /// Raises if `config` is not a valid configuration; builds nothing.
    #[staticmethod]
    fn check_config(config: BatcherConfigArg) -> PyResult<()> {
        config.0.validate().into_py_result()
    }

    /// The configuration as a dict.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, self.lock().config())
    }

    /// Replaces the configuration (validated first); returns the previous one.
    fn set_config<'py>(
        &self,
        py: Python<'py>,
        config: BatcherConfigArg,
    ) -> PyResult<Bound<'py, PyDict>> {
        let previous = self.lock().set_config(config.0).into_py_result()?;
        config_dict(py, &previous)
    }

    /// Queues request `request_id`; QueueFullError if the queue is full.
    #[pyo3(signature = (request_id, priority, now_ns, timeout_ns=None))]
    fn submit(
        &self,
        request_id: SeqId,
        priority: Count<0>,
        now_ns: Nanos,
        timeout_ns: Option<Nanos>,
    ) -> PyResult<()> {
        let request_id = request_id.0;
        let (priority, now_ns) = (priority.get(), now_ns.as_u64());
        let timeout_ns = timeout_ns.map(Nanos::as_u64);
        self.lock()
            .submit(request_id, priority, now_ns, timeout_ns)
            .into_py_result()
    }

    /// Takes a request out of the queue; False if it was not queued.
    fn cancel(&self, request_id: SeqId) -> PyResult<bool> {
        let request_id = request_id.0;
        Ok(self.lock().cancel(request_id))
    }

    /// (batch ids, expired ids, next wake-up in ns or None) at time `now_ns`.
    fn poll(&self, now_ns: Nanos) -> PyResult<(Vec<u64>, Vec<u64>, Option<u64>)> {
        let now_ns = now_ns.as_u64();
        let poll = self.lock().poll(now_ns);
        Ok((poll.batch, poll.expired, poll.next_wakeup_ns))
    }

    /// Empties the queue; returns the waiting ids by priority then arrival.
    fn drain(&self) -> Vec<u64> {
        self.lock().drain()
    }

    fn __len__(&self) -> usize {
        self.lock().len()
    }

    fn __contains__(&self, request_id: SeqId) -> PyResult<bool> {
        let request_id = request_id.0;
        Ok(self.lock().contains(request_id))
    }
}
