//! Byte movers for host-memory backings (numpy, or CPU torch through a numpy view): each
//! call is one pass of bounds-checked `memcpy`s, so a copy of N bytes costs N bytes of
//! traffic, where gather-then-scatter through fancy indexing costs twice that. The core plans
//! what moves; these only move it. Device backings use torch instead.
//!
//! Sources that overlap the destination (two numpy arrays over the same memory need not
//! share a base object, so numpy's own borrow tracking cannot see it) are copied aside first.

use std::borrow::Cow;

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::convert::BlockPairs;
use crate::errors::value_error;

/// Copies smaller than this run with the GIL held: releasing it costs more than they do.
const DETACH_BYTES: usize = 1 << 20;

fn checked(a: usize, b: usize, what: &str) -> PyResult<usize> {
    a.checked_mul(b)
        .ok_or_else(|| value_error(format!("{what} overflows")))
}

/// (address, length) of a contiguous uint8 array.
fn extent(array: &Bound<'_, PyArray1<u8>>, what: &str) -> PyResult<(usize, usize)> {
    if !array.is_contiguous() {
        return Err(value_error(format!("{what} must be contiguous")));
    }
    Ok((array.data() as usize, array.len()))
}

fn overlaps((a, a_len): (usize, usize), (b, b_len): (usize, usize)) -> bool {
    a < b + b_len && b < a + a_len
}

/// The bytes of `src`, borrowed, or copied aside if they overlap `dst`.
fn source<'a>(src: &'a Bound<'_, PyArray1<u8>>, dst: (usize, usize)) -> PyResult<Cow<'a, [u8]>> {
    let range = extent(src, "a source")?;
    // SAFETY: contiguous, `len` bytes long, alive for 'a; nothing writes it while this call
    // runs except through `dst`, and overlapping sources are copied before `dst` is written.
    let bytes = unsafe { std::slice::from_raw_parts(range.0 as *const u8, range.1) };
    Ok(if overlaps(range, dst) {
        Cow::Owned(bytes.to_vec())
    } else {
        Cow::Borrowed(bytes)
    })
}

/// `dst` borrowed for writing (numpy refuses a read-only array here).
fn destination<'py>(dst: &Bound<'py, PyArray1<u8>>) -> PyResult<numpy::PyReadwriteArray1<'py, u8>> {
    dst.try_readwrite()
        .map_err(|_| value_error("dst is read-only, or borrowed elsewhere"))
}

fn run(py: Python<'_>, bytes: usize, work: impl FnOnce() + Send) {
    if bytes >= DETACH_BYTES {
        py.detach(work);
    } else {
        work();
    }
}

/// ATB's ReshapeAndCache on host bytes. For each `(offset, src)` in `sources`, the bytes of
/// `dst` from `offset` on are `rows_per_source` rows of `row_bytes`, and
/// `dst[offset + rows[i]] = src[i]` for every `rows[i] >= 0` (negative rows are padding). One
/// call writes a layer's keys and values: two sources, one pass.
#[pyfunction]
pub fn scatter_rows(
    py: Python<'_>,
    dst: &Bound<'_, PyArray1<u8>>,
    row_bytes: usize,
    rows_per_source: usize,
    rows: &Bound<'_, PyArray1<i64>>,
    sources: Vec<(usize, Bound<'_, PyArray1<u8>>)>,
) -> PyResult<()> {
    let dst_extent = extent(dst, "dst")?;
    let rows = rows.try_readonly()?;
    let rows = rows
        .as_slice()
        .map_err(|_| value_error("rows must be contiguous"))?;
    let span = checked(rows_per_source, row_bytes, "rows_per_source × row_bytes")?;
    let row_span = checked(rows.len(), row_bytes, "rows × row_bytes")?;
    if row_bytes == 0 {
        return Err(value_error("row_bytes must be at least 1"));
    }
    let mut slices = Vec::with_capacity(sources.len());
    for (offset, src) in &sources {
        let src = source(src, dst_extent)?;
        if src.len() != row_span {
            return Err(value_error(format!(
                "{} source bytes are not {} rows of {row_bytes}",
                src.len(),
                rows.len()
            )));
        }
        if offset
            .checked_add(span)
            .is_none_or(|end| end > dst_extent.1)
        {
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
    let mut dst = destination(dst)?;
    let dst = dst
        .as_slice_mut()
        .map_err(|_| value_error("dst must be contiguous"))?;
    run(py, row_span.saturating_mul(slices.len()), || {
        for (offset, src) in &slices {
            for (&row, chunk) in rows.iter().zip(src.chunks_exact(row_bytes)) {
                if row >= 0 {
                    let start = offset + row as usize * row_bytes;
                    dst[start..start + row_bytes].copy_from_slice(chunk);
                }
            }
        }
    });
    Ok(())
}

/// Block copies between (or within) tiers laid out as `[groups, blocks, chunk_bytes]`: for
/// every group, `dst[group, d] = src[group, s]` for each `(s, d)` in `pairs`. Without `src`
/// the copies are within `dst` (copy-on-write).
#[pyfunction]
#[pyo3(signature = (dst, dst_blocks, src, src_blocks, chunk_bytes, pairs))]
pub fn copy_blocks(
    py: Python<'_>,
    dst: &Bound<'_, PyArray1<u8>>,
    dst_blocks: usize,
    src: Option<&Bound<'_, PyArray1<u8>>>,
    src_blocks: usize,
    chunk_bytes: usize,
    pairs: BlockPairs,
) -> PyResult<()> {
    let dst_extent = extent(dst, "dst")?;
    let group_bytes = checked(dst_blocks, chunk_bytes, "dst_blocks × chunk_bytes")?;
    if group_bytes == 0 || dst_extent.1 % group_bytes != 0 {
        return Err(value_error(
            "dst is not whole groups of dst_blocks × chunk_bytes",
        ));
    }
    let groups = dst_extent.1 / group_bytes;
    let src_bytes = match src {
        Some(src) => Some(source(src, dst_extent)?),
        None => None,
    };
    let src_blocks = if src_bytes.is_some() {
        src_blocks
    } else {
        dst_blocks
    };
    if let Some(src) = &src_bytes {
        let expected = checked(
            checked(groups, src_blocks, "groups × src_blocks")?,
            chunk_bytes,
            "source size",
        )?;
        if src.len() != expected {
            return Err(value_error(
                "src is not the same number of groups of src_blocks",
            ));
        }
    }
    let moves = pairs.0;
    if let Some([from, to]) = moves
        .iter()
        .find(|&&[from, to]| from >= src_blocks || to >= dst_blocks)
    {
        return Err(value_error(format!(
            "block pair ({from}, {to}) is out of range"
        )));
    }
    let mut dst = destination(dst)?;
    let dst = dst
        .as_slice_mut()
        .map_err(|_| value_error("dst must be contiguous"))?;
    let total = moves
        .len()
        .saturating_mul(groups)
        .saturating_mul(chunk_bytes);
    run(py, total, || {
        for group in 0..groups {
            for &[from, to] in &moves {
                let to = (group * dst_blocks + to) * chunk_bytes;
                match &src_bytes {
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
