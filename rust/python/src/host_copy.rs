//! Byte movers for host-memory backings (numpy, or CPU torch through a numpy view): each
//! call is one pass of bounds-checked `memcpy`s with the GIL released, so a copy of N bytes
//! costs N bytes of traffic, where gather-then-scatter through fancy indexing costs twice
//! that. The core plans what moves; these only move it. Device backings use torch instead.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray1};
use pyo3::prelude::*;

use crate::errors::value_error;

/// Copies smaller than this run with the GIL held: releasing it costs more than they do.
const DETACH_BYTES: usize = 1 << 20;

/// ATB's ReshapeAndCache on host bytes. For each `(offset, src)` in `sources`, the bytes of
/// `dst` from `offset` on are rows of `row_bytes`, and `dst[offset + rows[i]] = src[i]` for
/// every `rows[i] >= 0` (negative rows are padding). One call writes a layer's keys and
/// values: two sources, one pass.
#[pyfunction]
pub fn scatter_rows(
    py: Python<'_>,
    mut dst: PyReadwriteArray1<'_, u8>,
    row_bytes: usize,
    rows_per_source: usize,
    rows: PyReadonlyArray1<'_, i64>,
    sources: Vec<(usize, PyReadonlyArray1<'_, u8>)>,
) -> PyResult<()> {
    let dst = dst
        .as_slice_mut()
        .map_err(|_| value_error("dst must be contiguous"))?;
    let rows = rows
        .as_slice()
        .map_err(|_| value_error("rows must be contiguous"))?;
    let span = rows_per_source
        .checked_mul(row_bytes)
        .ok_or_else(|| value_error("rows_per_source × row_bytes overflows"))?;
    let mut slices = Vec::with_capacity(sources.len());
    for (offset, src) in &sources {
        let src = src
            .as_slice()
            .map_err(|_| value_error("sources must be contiguous"))?;
        if row_bytes == 0 || src.len() != rows.len() * row_bytes {
            return Err(value_error(format!(
                "{} source bytes are not {} rows of {row_bytes}",
                src.len(),
                rows.len()
            )));
        }
        if offset.checked_add(span).is_none_or(|end| end > dst.len()) {
            return Err(value_error(format!(
                "rows from offset {offset} run past the destination"
            )));
        }
        slices.push((*offset, src));
    }
    if let Some(&bad) = rows.iter().find(|&&row| row >= rows_per_source as i64) {
        return Err(value_error(format!(
            "row {bad} is outside the {rows_per_source} rows"
        )));
    }
    let mut work = || {
        for (offset, src) in &slices {
            for (&row, chunk) in rows.iter().zip(src.chunks_exact(row_bytes)) {
                if row >= 0 {
                    let start = offset + row as usize * row_bytes;
                    dst[start..start + row_bytes].copy_from_slice(chunk);
                }
            }
        }
    };
    if rows.len() * row_bytes * slices.len() >= DETACH_BYTES {
        py.detach(work);
    } else {
        work();
    }
    Ok(())
}

/// Block copies between (or within) tiers laid out as `[groups, blocks, chunk_bytes]`: for
/// every group, `dst[group, d] = src[group, s]` for each `(s, d)` in `pairs`. Without `src`
/// the copies are within `dst` (copy-on-write).
#[pyfunction]
#[pyo3(signature = (dst, dst_blocks, src, src_blocks, chunk_bytes, pairs))]
pub fn copy_blocks(
    py: Python<'_>,
    mut dst: PyReadwriteArray1<'_, u8>,
    dst_blocks: usize,
    src: Option<PyReadonlyArray1<'_, u8>>,
    src_blocks: usize,
    chunk_bytes: usize,
    pairs: PyReadonlyArray2<'_, i32>,
) -> PyResult<()> {
    let dst = dst
        .as_slice_mut()
        .map_err(|_| value_error("dst must be contiguous"))?;
    let pairs = pairs.as_array();
    if pairs.ncols() != 2 {
        return Err(value_error("pairs must have shape [k, 2]"));
    }
    if chunk_bytes == 0 || dst_blocks == 0 || dst.len() % (dst_blocks * chunk_bytes) != 0 {
        return Err(value_error(
            "dst is not whole groups of dst_blocks × chunk_bytes",
        ));
    }
    let groups = dst.len() / (dst_blocks * chunk_bytes);
    let src_slice = match &src {
        Some(src) => Some(
            src.as_slice()
                .map_err(|_| value_error("src must be contiguous"))?,
        ),
        None => None,
    };
    let src_blocks = if src_slice.is_some() {
        src_blocks
    } else {
        dst_blocks
    };
    if let Some(src) = src_slice {
        if src.len() != groups * src_blocks * chunk_bytes {
            return Err(value_error(
                "src is not the same number of groups of src_blocks",
            ));
        }
    }
    for pair in pairs.rows() {
        let (from, to) = (pair[0], pair[1]);
        if from < 0 || to < 0 || from as usize >= src_blocks || to as usize >= dst_blocks {
            return Err(value_error(format!(
                "block pair ({from}, {to}) is out of range"
            )));
        }
    }
    let pairs: Vec<(usize, usize)> = pairs
        .rows()
        .into_iter()
        .map(|p| (p[0] as usize, p[1] as usize))
        .collect();
    py.detach(|| {
        for group in 0..groups {
            for &(from, to) in &pairs {
                let to = (group * dst_blocks + to) * chunk_bytes;
                match src_slice {
                    Some(src) => {
                        let from = (group * src_blocks + from) * chunk_bytes;
                        dst[to..to + chunk_bytes].copy_from_slice(&src[from..from + chunk_bytes]);
                    }
                    None => {
                        let from = (group * dst_blocks + from) * chunk_bytes;
                        dst.copy_within(from..from + chunk_bytes, to);
                    }
                }
            }
        }
    });
    Ok(())
}
