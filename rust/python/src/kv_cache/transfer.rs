//! Plan → execute → commit across the language boundary: the core's block moves as an array
//! for Python's byte executor, and what happens when executing them raises.

use atb_mem_core::{BlockMove, KvCache};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2};
use pyo3::prelude::*;

use crate::errors::{block_move_error, type_error};

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
