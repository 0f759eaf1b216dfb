//! Core results into numpy arrays and dicts.

use atb_mem_core::Figures;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{type_error, value_error};

/// A stats struct as a dict of its figures (names and derived figures are the core's).
pub fn figures_to_dict<'py>(py: Python<'py>, stats: &impl Figures) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (name, figure) in stats.figures() {
        match figure {
            atb_mem_core::Figure::Int(value) => dict.set_item(name, value)?,
            atb_mem_core::Figure::Float(value) => dict.set_item(name, value)?,
            atb_mem_core::Figure::Text(value) => dict.set_item(name, value)?,
        }
    }
    Ok(dict)
}

pub fn narrow_slots(slots: &[i64]) -> PyResult<Vec<i32>> {
    slots
        .iter()
        .map(|&slot| {
            i32::try_from(slot).map_err(|_| value_error(format!("slot {slot} does not fit int32")))
        })
        .collect()
}

/// Row-major cells as a `[rows, width]` array, without copying them.
pub fn to_2d(
    py: Python<'_>,
    cells: Vec<i32>,
    rows: usize,
    width: usize,
) -> PyResult<Bound<'_, PyArray2<i32>>> {
    let array =
        Array2::from_shape_vec((rows, width), cells).map_err(|e| type_error(e.to_string()))?;
    Ok(array.into_pyarray(py))
}

/// Block pairs as an int32 `[k, 2]` array.
pub fn pairs_to_array<'py>(
    py: Python<'py>,
    pairs: &[[u32; 2]],
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let rows = pairs.len();
    let cells = pairs
        .iter()
        .flat_map(|&[src, dst]| [src as i32, dst as i32])
        .collect();
    to_2d(py, cells, rows, 2)
}
