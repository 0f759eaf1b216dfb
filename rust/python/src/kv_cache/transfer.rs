//! Plan → execute → commit across the language boundary: the core's block moves as an array
//! for Python's byte executor, and what happens when executing them raises.

use atb_mem_core::{pairs_of, BlockMove, KvCache, MoveKind};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2};
use pyo3::prelude::*;

use super::PyKvCachePool;
use crate::convert::{pairs_to_array, SeqIds};
use crate::errors::{block_move_error, type_error, IntoPyResult};

/// int32 `[k, 3]`: (kind, source block, destination block) per move, in execution order;
/// kind 0 = copy (device → device), 1 = to host, 2 = to device.
pub(crate) fn moves_to_array<'py>(
    py: Python<'py>,
    moves: &[BlockMove],
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let cells = moves
        .iter()
        .flat_map(|planned| [planned.kind as i32, planned.src as i32, planned.dst as i32])
        .collect();
    let array =
        Array2::from_shape_vec((moves.len(), 3), cells).map_err(|e| type_error(e.to_string()))?;
    Ok(array.into_pyarray(py))
}

/// Calls `execute(moves)`. On failure, also says how many moves may have run: the
/// exception's `moves_attempted` when the executor set it, else all of them.
pub(crate) fn call_executor(
    py: Python<'_>,
    execute: &Bound<'_, PyAny>,
    moves: &[BlockMove],
) -> Result<(), (PyErr, usize)> {
    let array = moves_to_array(py, moves).map_err(|error| (error, 0))?;
    execute.call1((array,)).map(drop).map_err(|error| {
        let attempted = error
            .value(py)
            .getattr("moves_attempted")
            .and_then(|value| value.extract::<usize>())
            .unwrap_or(moves.len());
        (error, attempted)
    })
}

/// Takes the cache's pending moves and executes them with `execute`, all under the caller's
/// lock. If that raises, the cache goes back to `snapshot` (taken before the operation that
/// planned the moves), the sequences whose bytes were lost are ended, and `BlockMoveError`
/// says which. Returns the moves executed.
pub(crate) fn execute_pending(
    py: Python<'_>,
    cache: &mut KvCache,
    snapshot: KvCache,
    execute: &Bound<'_, PyAny>,
) -> PyResult<Vec<BlockMove>> {
    let mut moves = Vec::new();
    cache.take_moves(&mut moves);
    if moves.is_empty() {
        return Ok(moves);
    }
    if let Err((error, attempted)) = call_executor(py, execute, &moves) {
        let mut aborted = Vec::new();
        cache.recover_from_failed_moves(snapshot, &moves, attempted, &mut aborted);
        return Err(block_move_error(py, error, &aborted));
    }
    Ok(moves)
}

impl PyKvCachePool {
    /// A swap as one transaction: plan it, execute every pending move with `execute` (None:
    /// leave them pending for the caller), and commit — or roll back if executing raised.
    /// Returns the swap's own (source, destination) pairs.
    pub(super) fn swap<'py>(
        &self,
        py: Python<'py>,
        seq_ids: SeqIds<'py>,
        execute: Option<&Bound<'py, PyAny>>,
        out: bool,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = seq_ids.as_slice();
        let mut cache = self.lock_running_python()?;
        let execute = execute.filter(|execute| !execute.is_none());
        let snapshot = execute.map(|_| cache.clone());
        let first = cache.num_pending_moves();
        match out {
            true => cache.swap_out(ids),
            false => cache.swap_in(ids),
        }
        .into_py_result()?;
        let kind = if out {
            MoveKind::ToHost
        } else {
            MoveKind::ToDevice
        };
        let pairs: Vec<[u32; 2]> = match (execute, snapshot) {
            (Some(execute), Some(snapshot)) => {
                let moves = execute_pending(py, &mut cache, snapshot, execute)?;
                if !out {
                    // The bytes are back: the blocks may serve prefix hits again.
                    for &seq_id in ids {
                        cache.mark_computed(seq_id, None).into_py_result()?;
                    }
                }
                pairs_of(&moves, kind).collect()
            }
            _ => pairs_of(&cache.pending_moves()[first..], kind).collect(),
        };
        pairs_to_array(py, &pairs)
    }
}
