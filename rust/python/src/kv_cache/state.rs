//! Recurrent layers' states on a `KVCachePool`: where each layer's state lives and which
//! blocks hold each sequence's.

use numpy::PyArray2;
use pyo3::prelude::*;

use super::PyKvCachePool;
use crate::convert::{to_2d, Count, SeqIds};
use crate::errors::IntoPyResult;

/// A state group as Python reads it: (layers, bytes of one layer's state, blocks per
/// sequence, first column in a state table).
type StateGroupRow = (Vec<usize>, usize, usize, usize);

#[pymethods]
impl PyKvCachePool {
    #[getter]
    fn _state_groups(&self) -> PyResult<Vec<StateGroupRow>> {
        let cache = self.lock()?;
        let groups = cache.state_groups().iter();
        Ok(groups
            .map(|g| {
                (
                    g.layers.clone(),
                    g.state_bytes,
                    g.num_blocks,
                    g.first_column,
                )
            })
            .collect())
    }

    /// Blocks each sequence holds for its recurrent layers' states, whatever its length.
    #[getter]
    fn num_state_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_state_blocks())
    }

    /// `(state group, slot)` of a recurrent layer: its state lies in slot `slot` of the
    /// group's state blocks.
    fn state_of_layer(&self, layer: Count<0>) -> PyResult<(usize, usize)> {
        self.lock()?.state_of_layer(layer.0).into_py_result()
    }

    /// int32 `[len(seq_ids), num_state_blocks]`: each sequence's state blocks, state group by
    /// state group (`state_groups[g].first_column` on). The sequences must be on the device.
    fn state_table<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = seq_ids.as_slice();
        let cache = self.lock()?;
        let width = cache.num_state_blocks();
        let mut cells = vec![0; ids.len() * width];
        cache.state_table(ids, &mut cells).into_py_result()?;
        drop(cache);
        to_2d(py, cells, ids.len(), width)
    }
}
