//! `ContinuousBatchScheduler`'s core: convert, lock (the KV cache, then the scheduler, as
//! every caller does), call, map errors. One `step` call builds every array of the plan.

use std::sync::Mutex;

use atb_mem_core::{ContinuousScheduler, Preemption, SchedulerConfig, StepPlan};
use numpy::{IntoPyArray, PyArray1, PyArray3, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PySlice};

use super::step_plan::PyStepPlan;
use crate::convert::{self, Count, Nanos, Prompt, SeqId, SeqIds, TokenIds};
use crate::errors::{type_error, value_error, IntoPyResult};
use crate::kv_cache::{retention_config, RangeArg};
use crate::kv_cache::{transfer, PyKvCachePool};
use crate::lock::{lock, Guard, PyLock};

/// A configuration: a dict with the keys `config()` returns, every one and nothing else.
pub struct SchedulerConfigArg(SchedulerConfig);

impl<'a, 'py> FromPyObject<'a, 'py> for SchedulerConfigArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        build_config(&obj).map(SchedulerConfigArg)
    }
}

fn build_config(config: &Bound<'_, PyAny>) -> PyResult<SchedulerConfig> {
    let [max_num_seqs, max_num_batched_tokens, chunked, preemption_name, watermark] =
        convert::config_items(
            config,
            [
                "max_num_seqs",
                "max_num_batched_tokens",
                "enable_chunked_prefill",
                "preemption",
                "watermark",
            ],
        )?;
    Ok(SchedulerConfig {
        max_num_seqs: convert::count(&max_num_seqs, "max_num_seqs", 1)?,
        max_num_batched_tokens: convert::count(
            &max_num_batched_tokens,
            "max_num_batched_tokens",
            1,
        )?,
        enable_chunked_prefill: chunked
            .cast::<PyBool>()
            .map_err(|_| {
                type_error(format!(
                    "enable_chunked_prefill must be a bool, got {}",
                    convert::describe(&chunked)
                ))
            })?
            .is_true(),
        preemption: Preemption::parse(
            preemption_name
                .extract::<&str>()
                .map_err(|_| value_error("preemption must be \"recompute\" or \"swap\""))?,
        )
        .into_py_result()?,
        watermark: convert::number(&watermark, "watermark")?,
    })
}

fn config_dict<'py>(py: Python<'py>, config: &SchedulerConfig) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("max_num_seqs", config.max_num_seqs)?;
    dict.set_item("max_num_batched_tokens", config.max_num_batched_tokens)?;
    dict.set_item("enable_chunked_prefill", config.enable_chunked_prefill)?;
    dict.set_item("preemption", config.preemption.name())?;
    dict.set_item("watermark", config.watermark)?;
    Ok(dict)
}

/// Continuous-batching policy over a `KVCachePool` (see `atb_mem.ContinuousBatchScheduler`).
#[pyclass(frozen, name = "ContinuousScheduler", module = "atb_mem._core")]
pub struct PyContinuousScheduler {
    pool: Py<PyKvCachePool>,
    scheduler: PyLock<ContinuousScheduler>,
    /// The plans' block tables: one numpy buffer `[groups, rows, columns]` the core updates
    /// in place, grown by doubling (plans already returned keep the old one alive).
    block_tables: Mutex<Option<Py<PyArray3<i32>>>>,
}

impl PyContinuousScheduler {
    fn lock(&self) -> PyResult<Guard<'_, ContinuousScheduler>> {
        self.scheduler.lock()
    }

    /// Writes the plan's block tables into the persistent buffer (under the caller's locks),
    /// replaced by one of the shape the core asks for when it no longer fits, and returns the
    /// read-only `[rows, width]` view of them (`[groups, rows, width]` with several groups).
    fn block_tables_view<'py>(
        &self,
        py: Python<'py>,
        scheduler: &mut ContinuousScheduler,
        cache: &atb_mem_core::KvCache,
        plan: &StepPlan,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut buffer = lock(&self.block_tables);
        let held = buffer.as_ref().map(|array| {
            let dims = array.bind(py).dims();
            [dims[0], dims[1], dims[2]]
        });
        let grown = plan.block_table_shape(held);
        if let Some(shape) = grown {
            *buffer = Some(PyArray3::zeros(py, shape, false).unbind());
        }
        let array = buffer.as_ref().map(|array| array.bind(py).clone());
        let array = array.ok_or_else(|| type_error("block table buffer missing"))?;
        let stride = array.dims()[2];
        // SAFETY: the buffer is C-contiguous and created here; Python sees it only through
        // read-only views, and every write happens under the scheduler's lock.
        let cells = unsafe { array.as_slice_mut() }.map_err(|e| type_error(e.to_string()))?;
        scheduler
            .write_block_tables(cache, plan, cells, stride, grown.is_some())
            .into_py_result()?;
        let (rows, columns) = (
            PySlice::new(py, 0, plan.query_lens.len() as isize, 1),
            PySlice::new(py, 0, plan.block_table_width as isize, 1),
        );
        let view = match plan.num_groups {
            1 => array.get_item((0, rows, columns))?,
            _ => array.get_item((PySlice::full(py), rows, columns))?,
        };
        let flags = PyDict::new(py);
        flags.set_item("write", false)?;
        view.call_method("setflags", (), Some(&flags))?;
        Ok(view)
    }
}

#[pymethods]
impl PyContinuousScheduler {
    /// `config`: a dict with the keys `config()` returns.
    #[new]
    fn new(kv_cache: &Bound<'_, PyAny>, config: SchedulerConfigArg) -> PyResult<Self> {
        let pool = kv_cache.cast::<PyKvCachePool>().map_err(|_| {
            type_error(format!(
                "kv_cache must be a KVCachePool, got {}",
                convert::type_name(kv_cache)
            ))
        })?;
        let scheduler =
            ContinuousScheduler::new(config.0, &*pool.get().lock()?).into_py_result()?;
        Ok(PyContinuousScheduler {
            pool: pool.clone().unbind(),
            scheduler: PyLock::new(scheduler),
            block_tables: Mutex::new(None),
        })
    }

    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, &self.lock()?.config())
    }

    /// Whether `config` could replace the current one (valid, and no request in the
    /// scheduler would be stranded by it); raises otherwise. Changes nothing.
    fn check_config(&self, config: SchedulerConfigArg) -> PyResult<()> {
        let cache = self.pool.get().lock()?;
        self.lock()?.check_config(config.0, &cache).into_py_result()
    }

    /// Whether a new request could ever be scheduled under `config`; raises otherwise.
    fn check_request(
        &self,
        config: SchedulerConfigArg,
        seq_id: SeqId,
        prompt: Prompt<'_>,
        max_new_tokens: Count<1>,
        num_samples: Count<1>,
    ) -> PyResult<()> {
        let cache = self.pool.get().lock()?;
        ContinuousScheduler::check_new_request(
            config.0,
            &cache,
            seq_id.0,
            prompt.tokens().len(),
            max_new_tokens.get(),
            num_samples.get(),
        )
        .into_py_result()
    }

    /// Validated first; returns the previous configuration.
    fn set_config<'py>(
        &self,
        py: Python<'py>,
        config: SchedulerConfigArg,
    ) -> PyResult<Bound<'py, PyDict>> {
        let cache = self.pool.get().lock()?;
        let previous = self.lock()?.set_config(config.0, &cache).into_py_result()?;
        config_dict(py, &previous)
    }

    #[pyo3(signature = (seq_id, prompt, max_new_tokens, priority, arrival_ns, num_samples=None))]
    fn add_request(
        &self,
        seq_id: SeqId,
        prompt: Prompt<'_>,
        max_new_tokens: Count<1>,
        priority: Count<0>,
        arrival_ns: Nanos,
        num_samples: Option<Count<1>>,
    ) -> PyResult<()> {
        let priority = u32::try_from(priority.get())
            .map_err(|_| value_error("priority must be below 2**32"))?;
        let mut cache = self.pool.get().lock()?;
        self.lock()?
            .add_request(
                &mut cache,
                seq_id.0,
                prompt.tokens(),
                max_new_tokens.get(),
                num_samples.map_or(1, |count| count.get()),
                priority,
                arrival_ns.as_u64(),
            )
            .into_py_result()
    }

    /// What request `seq_id` asks the prefix cache to keep (as `KVCachePool.set_retention`
    /// takes it); its decode tokens start where its prompt ends. Its sequence takes it at
    /// every admission.
    #[pyo3(signature = (seq_id, ranges, *, decode=None, default_priority=None))]
    fn set_retention(
        &self,
        seq_id: SeqId,
        ranges: Vec<RangeArg>,
        decode: Option<(Count<0>, Option<Nanos>)>,
        default_priority: Option<Count<0>>,
    ) -> PyResult<()> {
        let config = retention_config(ranges, decode, default_priority)?;
        let mut cache = self.pool.get().lock()?;
        self.lock()?
            .set_retention(&mut cache, seq_id.0, config)
            .into_py_result()
    }

    /// Plans one step; returns the plan as a dict of numpy arrays (and a few ints).
    ///
    /// With `execute`, the step is one transaction under both locks: plan, execute the
    /// moves (`execute(moves)`, int32 `[k, 3]` in order), commit. If executing raises, the
    /// scheduler and the cache go back to where they were before the step and
    /// `BlockMoveError` names the requests whose bytes were lost (they are ended).
    #[pyo3(signature = (now_ns, execute=None))]
    fn step<'py>(
        &self,
        py: Python<'py>,
        now_ns: Nanos,
        execute: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PyStepPlan> {
        let mut plan = StepPlan::default();
        let tables = {
            let mut cache = self.pool.get().lock_running_python()?;
            let mut scheduler = self.scheduler.lock_running_python()?;
            let now_ns = now_ns.as_u64();
            let result = match execute.as_ref().filter(|execute| !execute.is_none()) {
                Some(execute) => {
                    let mut raised = None;
                    let run = transfer::executor(py, execute, &mut raised);
                    let result = scheduler.step_executing(&mut cache, now_ns, &mut plan, run);
                    transfer::into_py_result(result, raised)
                }
                None => scheduler
                    .step(&mut cache, now_ns, &mut plan)
                    .into_py_result(),
            };
            result?;
            self.block_tables_view(py, &mut scheduler, &cache, &plan)?
        };
        Ok(PyStepPlan::new(py, plan, tables))
    }

    /// Records sampled tokens; returns the ids of the sequences that finished.
    #[pyo3(signature = (seq_ids, token_ids, eos_token_id=None))]
    fn on_tokens<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
        token_ids: TokenIds<'py>,
        eos_token_id: Option<Count<0>>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let eos = match eos_token_id {
            Some(eos) => Some(
                u32::try_from(eos.get())
                    .map_err(|_| value_error("eos_token_id must be below 2**32"))?,
            ),
            None => None,
        };
        let mut finished = Vec::new();
        {
            let mut cache = self.pool.get().lock()?;
            self.lock()?
                .on_tokens(
                    &mut cache,
                    seq_ids.as_slice(),
                    token_ids.as_slice(),
                    eos,
                    &mut finished,
                )
                .into_py_result()?;
        }
        Ok(finished.into_pyarray(py))
    }

    /// Says that lower tiers (a disk tier, a shared store) hold the first `num_blocks` full
    /// blocks of waiting request `seq_id`: its admission loads what the device and the host
    /// do not hold (the plan's `load_*` arrays), and it waits until `finish_loads`.
    fn offer_external_prefix(&self, seq_id: SeqId, num_blocks: Count<0>) -> PyResult<()> {
        let cache = self.pool.get().lock()?;
        self.lock()?
            .offer_external_prefix(&cache, seq_id.0, num_blocks.get())
            .into_py_result()
    }

    /// Reports loads: `done[i]` whether every block of request `seq_ids[i]` arrived intact
    /// (then they count as computed), or not (they are recomputed). All-or-nothing.
    fn finish_loads(&self, seq_ids: SeqIds<'_>, done: Vec<bool>) -> PyResult<()> {
        let mut cache = self.pool.get().lock()?;
        self.lock()?
            .finish_loads(&mut cache, seq_ids.as_slice(), &done)
            .into_py_result()
    }

    /// Ends a request wherever it is and frees its blocks.
    fn abort(&self, seq_id: SeqId) -> PyResult<()> {
        let seq_id = seq_id.0;
        let mut cache = self.pool.get().lock()?;
        self.lock()?.abort(&mut cache, seq_id).into_py_result()
    }

    /// Parallel sampling: `child` becomes a copy-on-write copy of `parent`, which a step
    /// sampled and `on_tokens` has not yet been told about.
    fn fork(&self, parent_seq_id: SeqId, child_seq_id: SeqId) -> PyResult<()> {
        let mut cache = self.pool.get().lock()?;
        self.lock()?
            .fork(&mut cache, parent_seq_id.0, child_seq_id.0)
            .into_py_result()
    }

    /// (prompt length, tokens sampled so far, max_new_tokens).
    fn progress(&self, seq_id: SeqId) -> PyResult<(usize, usize, usize)> {
        let seq_id = seq_id.0;
        self.lock()?.progress(seq_id).into_py_result()
    }

    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let scheduler = self.lock()?;
        let dict = PyDict::new(py);
        dict.set_item("waiting", scheduler.num_waiting())?;
        dict.set_item("running", scheduler.num_running())?;
        dict.set_item("swapped", scheduler.num_swapped())?;
        dict.set_item("preemptions", scheduler.num_preemptions())?;
        dict.set_item("loading", scheduler.num_loading())?;
        let loads = scheduler.load_counters();
        dict.set_item("loads_started", loads.started)?;
        dict.set_item("loaded_blocks", loads.loaded_blocks)?;
        dict.set_item("load_failures", loads.failed)?;
        Ok(dict)
    }

    fn __contains__(&self, seq_id: SeqId) -> PyResult<bool> {
        let seq_id = seq_id.0;
        Ok(self.lock()?.contains(seq_id))
    }

    fn _check_invariants(&self) -> PyResult<()> {
        let cache = self.pool.get().lock()?;
        self.lock()?
            .check_invariants(&cache)
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }
}
