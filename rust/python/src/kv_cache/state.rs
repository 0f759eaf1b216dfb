//! Recurrent layers' states on a `KVCachePool`: where each layer's state lives and which
//! blocks hold each sequence's.

use numpy::PyArray2;
use pyo3::prelude::*;

use super::PyKvCachePool;
use crate::convert::{to_2d, Count, SeqId, SeqIds};
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

    /// Blocks between two checkpoints of a sequence's recurrent states (prefix hits for a
    /// model with recurrent layers resume from one).
    #[getter]
    fn state_checkpoint_interval(&self) -> PyResult<usize> {
        Ok(self.lock()?.state_checkpoint_interval())
    }

    /// Tokens between two checkpoints: `state_checkpoint_interval × block_size`, 0 when this
    /// cache keeps none (no recurrent layers, prefix caching off, or a windowed group).
    #[getter]
    fn checkpoint_stride(&self) -> PyResult<usize> {
        Ok(self.lock()?.checkpoint_stride())
    }

    /// Keeps a checkpoint of the sequence's recurrent states at its computed tokens if they
    /// end on the stride, its token ids are known, none is cached there and free blocks hold
    /// one; returns whether it planned the copies (run the pending moves before the
    /// sequence's next tokens change its states). A scheduler does this itself.
    fn checkpoint_state(&self, seq_id: SeqId) -> PyResult<bool> {
        self.lock()?.checkpoint_state(seq_id.0).into_py_result()
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
