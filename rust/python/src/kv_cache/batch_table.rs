//! `BatchTable`: the persistent decode-step buffers, as read-only numpy views.

use atb_mem_core::{BatchTable, KvCache};
use numpy::ndarray::{ArrayView1, ArrayViewD};
use numpy::{PyArray1, PyArrayDyn};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{PyKvCachePool, DETACH_ABOVE};
use crate::convert::{SeqId, TokenIds};
use crate::errors::IntoPyResult;
use crate::lock::{Guard, PyLock};

/// Block tables, context lengths and slot mapping of the running batch, kept at fixed
/// addresses and updated in place by `append_tokens`.
#[pyclass(frozen, name = "BatchTable", module = "atb_mem._core")]
pub struct PyBatchTable {
    pub(super) pool: Py<PyKvCachePool>,
    pub(super) table: PyLock<BatchTable>,
}

impl PyBatchTable {
    fn lock(&self) -> PyResult<Guard<'_, BatchTable>> {
        self.table.lock()
    }

    /// A read-only numpy view of one of the table's buffers, keeping the table alive.
    fn view<'py, A: numpy::ndarray::Dimension>(
        slf: &Bound<'py, Self>,
        buffer: impl FnOnce(&BatchTable) -> numpy::ndarray::ArrayView<'_, i32, A>,
    ) -> PyResult<Bound<'py, numpy::PyArray<i32, A>>> {
        let table = slf.get().lock()?;
        let view = buffer(&table);
        // SAFETY: the buffers are boxed slices allocated once in `BatchTable::new` and never
        // resized or freed while the table lives; the array holds a reference to the table.
        let array = unsafe { numpy::PyArray::borrow_from_array(&view, slf.clone().into_any()) };
        drop(table);
        let flags = PyDict::new(slf.py());
        flags.set_item("write", false)?;
        array.call_method("setflags", (), Some(&flags))?;
        Ok(array)
    }
}

/// `shape` per group: as is for one group, with a leading group axis for several.
fn grouped_shape(table: &BatchTable, shape: &[usize]) -> Vec<usize> {
    match table.num_groups() {
        1 => shape.to_vec(),
        groups => [&[groups], shape].concat(),
    }
}

#[pymethods]
impl PyBatchTable {
    fn add(&self, seq_id: SeqId) -> PyResult<()> {
        let seq_id = seq_id.0;
        let cache = self.pool.get().lock()?;
        self.lock()?.add(&cache, seq_id).into_py_result()
    }

    fn remove(&self, seq_id: SeqId) -> PyResult<()> {
        let seq_id = seq_id.0;
        self.lock()?.remove(seq_id).into_py_result()
    }

    fn clear(&self) -> PyResult<()> {
        self.lock()?.clear();
        Ok(())
    }

    /// Appends one token to every row (`token_ids[row]` when given); updates the buffers.
    #[pyo3(signature = (token_ids=None))]
    fn append_tokens(&self, py: Python<'_>, token_ids: Option<TokenIds<'_>>) -> PyResult<()> {
        let rows = self.lock()?.len();
        let ids = token_ids.as_ref().map(|ids| ids.as_slice());
        let mut cache_guard = self.pool.get().lock()?;
        let mut table_guard = self.lock()?;
        let (cache, table): (&mut KvCache, &mut BatchTable) = (&mut cache_guard, &mut table_guard);
        if rows > DETACH_ABOVE {
            py.detach(|| table.append_tokens(cache, ids))
        } else {
            table.append_tokens(cache, ids)
        }
        .into_py_result()
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.len())
    }

    fn __contains__(&self, seq_id: SeqId) -> PyResult<bool> {
        let seq_id = seq_id.0;
        Ok(self.lock()?.contains(seq_id))
    }

    /// Sequence ids by row.
    #[getter]
    fn seq_ids(&self) -> PyResult<Vec<u64>> {
        Ok(self.lock()?.seq_ids().collect())
    }

    #[getter]
    fn max_seqs(&self) -> PyResult<usize> {
        Ok(self.lock()?.max_seqs())
    }

    #[getter]
    fn max_blocks_per_seq(&self) -> PyResult<usize> {
        Ok(self.lock()?.max_blocks_per_seq())
    }

    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyKvCachePool> {
        self.pool.clone_ref(py)
    }

    /// int32 `[max_seqs, max_blocks_per_seq]`, padded with block 0 (read-only view); with
    /// several KV-cache groups, `[groups, max_seqs, max_blocks_per_seq]`.
    #[getter]
    fn block_tables<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArrayDyn<i32>>> {
        Self::view(slf, |table| {
            let rows = [table.max_seqs(), table.max_blocks_per_seq()];
            ArrayViewD::from_shape(grouped_shape(table, &rows), table.block_tables())
                .expect("buffer matches its shape")
        })
    }

    /// int32 `[max_seqs]`, 0 for unused rows (read-only view).
    #[getter]
    fn context_lens<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        Self::view(slf, |table| ArrayView1::from(table.context_lens()))
    }

    /// int32 `[max_seqs]`: each row's newest slot, -1 for rows without one (read-only view);
    /// with several KV-cache groups, `[groups, max_seqs]`.
    #[getter]
    fn slot_mapping<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArrayDyn<i32>>> {
        Self::view(slf, |table| {
            ArrayViewD::from_shape(
                grouped_shape(table, &[table.max_seqs()]),
                table.slot_mapping(),
            )
            .expect("buffer matches its shape")
        })
    }

    fn __repr__(&self) -> PyResult<String> {
        let table = self.lock()?;
        Ok(format!(
            "BatchTable(rows={}, max_seqs={}, max_blocks_per_seq={})",
            table.len(),
            table.max_seqs(),
            table.max_blocks_per_seq()
        ))
    }
}
