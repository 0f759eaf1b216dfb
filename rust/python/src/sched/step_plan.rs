//! `StepPlan`: one step's decisions and a model runner's inputs, as numpy arrays, built in one
//! pass from the core's plan (the field list lives here and in the core, nowhere else).

use atb_mem_core::{pairs_of, BlockLoad, BlockMove, MoveKind, StepPlan};
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::prelude::*;

use crate::convert::pairs_to_array;
use crate::kv_cache::transfer::moves_to_array;

/// One step's decisions, and the arrays a paged-attention model runner feeds its kernels
/// (vLLM's model-runner names). Rows are the scheduled sequences, prefills first. All int32
/// but the ids (uint64). See `ContinuousBatchScheduler.step`.
#[pyclass(frozen, name = "StepPlan", module = "atb_mem._core")]
pub struct PyStepPlan {
    #[pyo3(get)]
    prefill_seq_ids: Py<PyAny>,
    #[pyo3(get)]
    prefill_tokens: Py<PyAny>,
    #[pyo3(get)]
    decode_seq_ids: Py<PyAny>,
    #[pyo3(get)]
    sample_seq_ids: Py<PyAny>,
    #[pyo3(get)]
    preempted_seq_ids: Py<PyAny>,
    #[pyo3(get)]
    finished_seq_ids: Py<PyAny>,
    /// int32 `[k, 3]`: (kind, source block, destination block), in execution order.
    #[pyo3(get)]
    moves: Py<PyAny>,
    #[pyo3(get)]
    query_lens: Py<PyAny>,
    /// K/V length of each row after this step (also `seq_lens`).
    #[pyo3(get)]
    context_lens: Py<PyAny>,
    #[pyo3(get)]
    query_start_loc: Py<PyAny>,
    /// `[rows, width]` read-only view of a buffer the scheduler updates in place: valid
    /// until the next step.
    #[pyo3(get)]
    block_tables: Py<PyAny>,
    #[pyo3(get)]
    input_ids: Py<PyAny>,
    #[pyo3(get)]
    positions: Py<PyAny>,
    #[pyo3(get)]
    slot_mapping: Py<PyAny>,
    #[pyo3(get)]
    logits_indices: Py<PyAny>,
    #[pyo3(get)]
    num_batched_tokens: usize,
    /// Blocks to load from lower tiers (made into arrays only when asked for: most steps
    /// have none, and most runners never look).
    loads: Vec<BlockLoad>,
    block_moves: Vec<BlockMove>,
    rows: usize,
}

impl PyStepPlan {
    pub(crate) fn new(py: Python<'_>, plan: StepPlan, block_tables: Bound<'_, PyAny>) -> Self {
        let ids = |values: Vec<u64>| values.into_pyarray(py).into_any().unbind();
        let cells = |values: Vec<i32>| values.into_pyarray(py).into_any().unbind();
        let moves =
            moves_to_array(py, &plan.moves).map_or_else(|_| py.None(), |a| a.into_any().unbind());
        PyStepPlan {
            rows: plan.query_lens.len(),
            prefill_seq_ids: ids(plan.prefill_seq_ids),
            prefill_tokens: cells(plan.prefill_tokens),
            decode_seq_ids: ids(plan.decode_seq_ids),
            sample_seq_ids: ids(plan.sample_seq_ids),
            preempted_seq_ids: ids(plan.preempted_seq_ids),
            finished_seq_ids: ids(plan.finished_seq_ids),
            moves,
            query_lens: cells(plan.query_lens),
            context_lens: cells(plan.context_lens),
            query_start_loc: cells(plan.query_start_loc),
            block_tables: block_tables.unbind(),
            input_ids: cells(plan.input_ids),
            positions: cells(plan.positions),
            slot_mapping: match plan.num_groups {
                0 | 1 => cells(plan.slot_mapping),
                groups => {
                    let tokens = plan.num_batched_tokens;
                    let slots = plan.slot_mapping.into_pyarray(py);
                    slots
                        .reshape([groups, tokens])
                        .map_or_else(|_| py.None(), |a| a.into_any().unbind())
                }
            },
            logits_indices: cells(plan.logits_indices),
            num_batched_tokens: plan.num_batched_tokens,
            loads: plan.loads,
            block_moves: plan.moves,
        }
    }

    fn pairs<'py>(&self, py: Python<'py>, kind: MoveKind) -> PyResult<Bound<'py, PyAny>> {
        let pairs: Vec<[u32; 2]> = pairs_of(&self.block_moves, kind).collect();
        Ok(pairs_to_array(py, &pairs)?.into_any())
    }
}

#[pymethods]
impl PyStepPlan {
    /// Copy-on-write moves as int32 `[k, 2]` (source, destination) pairs, in order.
    #[getter]
    fn copies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.pairs(py, MoveKind::Copy)
    }

    /// Device → host moves as `[k, 2]` pairs.
    #[getter]
    fn swap_out<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.pairs(py, MoveKind::ToHost)
    }

    /// Host → device moves as `[k, 2]` pairs.
    #[getter]
    fn swap_in<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.pairs(py, MoveKind::ToDevice)
    }

    /// Blocks to load from lower tiers, one entry per block, request by request: the
    /// request (uint64). See `ContinuousBatchScheduler.finish_loads`.
    #[getter]
    fn load_seq_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        let ids: Vec<u64> = self.loads.iter().map(|load| load.seq_id).collect();
        ids.into_pyarray(py)
    }

    /// Per block to load: the device block (int32).
    #[getter]
    fn load_blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let blocks: Vec<i32> = self.loads.iter().map(|load| load.block as i32).collect();
        blocks.into_pyarray(py)
    }

    /// Per block to load: the chain hash of its contents (uint64 `[k, 2]`).
    #[getter]
    fn load_keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let words: Vec<u64> = self.loads.iter().flat_map(|load| load.key.0).collect();
        Ok(words
            .into_pyarray(py)
            .reshape([self.loads.len(), 2])?
            .into_any())
    }

    /// vLLM's name for `context_lens`.
    #[getter]
    fn seq_lens(&self, py: Python<'_>) -> Py<PyAny> {
        self.context_lens.clone_ref(py)
    }

    /// Sequence ids by row.
    #[getter]
    fn seq_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let mut ids: Vec<u64> = self
            .prefill_seq_ids
            .bind(py)
            .cast::<PyArray1<u64>>()?
            .to_vec()?;
        ids.extend(
            self.decode_seq_ids
                .bind(py)
                .cast::<PyArray1<u64>>()?
                .to_vec()?,
        );
        Ok(ids.into_pyarray(py))
    }

    fn __len__(&self) -> usize {
        self.rows
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(rows={}, num_batched_tokens={}, moves={})",
            self.rows,
            self.num_batched_tokens,
            self.block_moves.len()
        )
    }
}
