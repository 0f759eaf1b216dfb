//! The Python byte executor as the core's: the core's block moves as an array, and the
//! exception it raises kept as the cause of the core's `MovesFailed`.

use atb_mem_core::{pairs_of, BlockMove, CoreError, MoveFailure, MoveKind};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2};
use pyo3::prelude::*;

use super::PyKvCachePool;
use crate::convert::{pairs_to_array, SeqIds};
use crate::errors::{to_py_err_caused_by, type_error, IntoPyResult};

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

/// Python's `execute(moves)` as the core's executor. What it raises goes to `raised`; the
/// core is told the exception's `moves_attempted` when the executor set it, else that all
/// of them may have run.
pub(crate) fn executor<'a>(
    py: Python<'a>,
    execute: &'a Bound<'a, PyAny>,
    raised: &'a mut Option<PyErr>,
) -> impl FnMut(&[BlockMove]) -> Result<(), MoveFailure> + 'a {
    move |moves| {
        let called = moves_to_array(py, moves).and_then(|array| execute.call1((array,)));
        let error = match called {
            Ok(_) => return Ok(()),
            Err(error) => error,
        };
        let attempted = error
            .value(py)
            .getattr("moves_attempted")
            .and_then(|value| value.extract::<usize>())
            .unwrap_or(moves.len());
        *raised = Some(error);
        Err(MoveFailure { attempted })
    }
}

/// A transaction's outcome as Python's: `BlockMoveError` caused by the executor's exception.
pub(crate) fn into_py_result<T>(
    result: Result<T, CoreError>,
    raised: Option<PyErr>,
) -> PyResult<T> {
    result.map_err(|error| to_py_err_caused_by(error, raised))
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
        let kind = if out {
            MoveKind::ToHost
        } else {
            MoveKind::ToDevice
        };
        let mut cache = self.lock_running_python()?;
        let pairs: Vec<[u32; 2]> = match execute.filter(|execute| !execute.is_none()) {
            Some(execute) => {
                let (mut raised, mut executed) = (None, Vec::new());
                let run = executor(py, execute, &mut raised);
                let result = match out {
                    true => cache.swap_out_executing(ids, run, &mut executed),
                    false => cache.swap_in_executing(ids, run, &mut executed),
                };
                into_py_result(result, raised)?;
                pairs_of(&executed, kind).collect()
            }
            None => {
                let first = cache.num_pending_moves();
                match out {
                    true => cache.swap_out(ids),
                    false => cache.swap_in(ids),
                }
                .into_py_result()?;
                pairs_of(&cache.pending_moves()[first..], kind).collect()
            }
        };
        pairs_to_array(py, &pairs)
    }
}
