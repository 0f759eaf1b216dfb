//! `content_digests`: the core's digests of a model's weights, from numpy byte arrays, with
//! the GIL released while the threads hash.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::Count;
use crate::errors::value_error;

/// The 32-byte BLAKE3 content digest of each contiguous uint8 array in `buffers`
/// (independent of `threads`: 0 takes every core).
#[pyfunction]
#[pyo3(signature = (buffers, threads=Count(0)))]
pub fn content_digests<'py>(
    py: Python<'py>,
    buffers: Vec<Bound<'py, PyArray1<u8>>>,
    threads: Count<0>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let borrowed: Vec<PyReadonlyArray1<'py, u8>> = buffers
        .iter()
        .map(|array| array.try_readonly())
        .collect::<Result<_, _>>()
        .map_err(|_| value_error("a buffer is borrowed for writing elsewhere"))?;
    let slices: Vec<&[u8]> = borrowed
        .iter()
        .map(|array| array.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|_| value_error("every buffer must be a contiguous uint8 array"))?;
    let digests = py.detach(|| atb_mem_core::content_digests(&slices, threads.get()));
    Ok(digests
        .iter()
        .map(|digest| PyBytes::new(py, digest))
        .collect())
}
