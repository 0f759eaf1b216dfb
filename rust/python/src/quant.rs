//! Quantized K/V rows to and from f32, the core's row formats, into arrays the caller owns,
//! with the GIL released.

use atb_mem_core::{quantize_rows, KvCacheDtype};
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::convert::Count;
use crate::errors::{value_error, IntoPyResult};

/// The quantized dtype named `name` (not "auto", which holds no rows).
fn quantized(name: &str) -> PyResult<KvCacheDtype> {
    match KvCacheDtype::parse(name).into_py_result()? {
        KvCacheDtype::Auto => Err(value_error(
            "kv_cache_dtype \"auto\" stores the model's dtype: it has no quantized rows",
        )),
        dtype => Ok(dtype),
    }
}

/// (head_dim, row bytes) of `values` (`[n, head_dim]` f32) and `rows` (`[n, row bytes]`), or
/// an error where the two do not pair up as rows of `dtype`.
fn row_sizes(dtype: KvCacheDtype, values: &[usize], rows: &[usize]) -> PyResult<(usize, usize)> {
    let (head_dim, row_bytes) = (values[1], rows[1]);
    if values[0] != rows[0] || dtype.row_bytes(head_dim) != Some(row_bytes) {
        return Err(value_error(format!(
            "values of shape {values:?} and quantized rows of shape {rows:?} disagree: a row \
             of {head_dim} values takes {} bytes",
            head_dim.saturating_add(dtype.row_bytes(0).unwrap_or(0))
        )));
    }
    Ok((head_dim, row_bytes))
}

/// Writes each row of `values` (f32 `[n, head_dim]`) as a quantized row of `out` (uint8
/// `[n, head_dim + 4]`), on `threads` threads (the attention kernel's).
#[pyfunction]
#[pyo3(signature = (values, out, kv_cache_dtype, *, threads=Count(1)))]
pub fn quantize_kv_rows(
    py: Python<'_>,
    values: PyReadonlyArray2<'_, f32>,
    out: &Bound<'_, PyArray2<u8>>,
    kv_cache_dtype: &str,
    threads: Count<1>,
) -> PyResult<()> {
    let dtype = quantized(kv_cache_dtype)?;
    let mut out = out
        .try_readwrite()
        .map_err(|_| value_error("out is borrowed elsewhere"))?;
    let (head_dim, _) = row_sizes(dtype, values.shape(), out.shape())?;
    let values = values
        .as_slice()
        .map_err(|_| value_error("values must be a C-contiguous float32 array"))?;
    let out = out
        .as_slice_mut()
        .map_err(|_| value_error("out must be a C-contiguous uint8 array"))?;
    if head_dim == 0 {
        return Ok(());
    }
    py.detach(|| quantize_rows(dtype, values, out, head_dim, threads.get()))
        .into_py_result()
}

/// Reads each quantized row of `rows` (uint8 `[n, head_dim + 4]`) into `out` (f32
/// `[n, head_dim]`).
#[pyfunction]
pub fn dequantize_kv_rows(
    py: Python<'_>,
    rows: PyReadonlyArray2<'_, u8>,
    out: &Bound<'_, PyArray2<f32>>,
    kv_cache_dtype: &str,
) -> PyResult<()> {
    let dtype = quantized(kv_cache_dtype)?;
    let mut out = out
        .try_readwrite()
        .map_err(|_| value_error("out is borrowed elsewhere"))?;
    let (head_dim, row_bytes) = row_sizes(dtype, out.shape(), rows.shape())?;
    let rows = rows
        .as_slice()
        .map_err(|_| value_error("rows must be a C-contiguous uint8 array"))?;
    let out = out
        .as_slice_mut()
        .map_err(|_| value_error("out must be a C-contiguous float32 array"))?;
    if head_dim > 0 {
        py.detach(|| {
            for (row_values, row) in out
                .chunks_exact_mut(head_dim)
                .zip(rows.chunks_exact(row_bytes))
            {
                dtype.dequantize_row(row, row_values);
            }
        });
    }
    Ok(())
}
