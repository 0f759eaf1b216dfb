//! Quantized K/V rows: what one token's keys (or values) for one KV head become in an int8
//! or fp8 cache, with the scale that reads them back stored at the row's end.
//!
//! A row's bytes depend on that row's values alone (its scale is its own, computed when it is
//! written), so a block never changes once written: a prefix hit, a copy-on-write, a swap or a
//! tier load reads exactly the bytes a recompute would write. The scale sits in the row's
//! trailer, not in a table beside the cache, so that every move of a block (which copies its
//! rows) carries its scales with it, and the kernel finds a row's scale right after the values
//! it scales.

mod fp8;
mod int8;

pub use fp8::{Fp8E4m3Rows, FP8_E4M3_MAX};
pub use int8::Int8Rows;

use crate::attention::{for_each_piece, InstructionSet, MAX_THREADS};
use crate::error::CoreResult;

/// How a cache stores K/V: in the model's dtype (`Auto`), or quantized per token and KV head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    #[default]
    Auto,
    /// `int8` values with a bfloat16 scale and offset per row (asymmetric).
    Int8,
    /// fp8 E4M3 (`e4m3fn`: no infinities, ±448 at most) values with an f32 scale per row.
    Fp8E4m3,
}

impl KvCacheDtype {
    /// Every cache dtype, by name.
    pub const ALL: [KvCacheDtype; 3] = [
        KvCacheDtype::Auto,
        KvCacheDtype::Int8,
        KvCacheDtype::Fp8E4m3,
    ];

    pub fn parse(name: &str) -> CoreResult<KvCacheDtype> {
        match name {
            "auto" => Ok(KvCacheDtype::Auto),
            "int8" => Ok(KvCacheDtype::Int8),
            "fp8_e4m3" | "fp8" => Ok(KvCacheDtype::Fp8E4m3),
            other => Err(invalid!(
                "unknown kv_cache_dtype {other:?}: expected one of auto, int8, fp8_e4m3"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Int8 => "int8",
            KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// Bytes of one quantized row of `head_dim` values (values, then the trailer); `None`
    /// for `Auto` (the model's dtype decides) or on overflow.
    pub fn row_bytes(self, head_dim: usize) -> Option<usize> {
        match self {
            KvCacheDtype::Auto => None,
            KvCacheDtype::Int8 => head_dim.checked_add(Int8Rows::TRAILER),
            KvCacheDtype::Fp8E4m3 => head_dim.checked_add(Fp8E4m3Rows::TRAILER),
        }
    }

    /// Writes `values` as one row of this dtype into `row` (`row_bytes(values.len())` long).
    #[inline(always)]
    pub fn quantize_row(self, values: &[f32], row: &mut [u8]) {
        match self {
            KvCacheDtype::Auto => panic!("an auto cache holds no quantized rows"),
            KvCacheDtype::Int8 => Int8Rows::quantize(values, row),
            KvCacheDtype::Fp8E4m3 => Fp8E4m3Rows::quantize(values, row),
        }
    }

    /// Reads one row of this dtype back into `values` (the row's `head_dim` long).
    pub fn dequantize_row(self, row: &[u8], values: &mut [f32]) {
        match self {
            KvCacheDtype::Auto => panic!("an auto cache holds no quantized rows"),
            KvCacheDtype::Int8 => Int8Rows::dequantize(row, values),
            KvCacheDtype::Fp8E4m3 => Fp8E4m3Rows::dequantize(row, values),
        }
    }
}

/// 1.5 x 2^23: an f32 of magnitude under 2^22 added to it is rounded to an integer.
const ROUNDING: f32 = 12_582_912.0;

/// Lanes a row's reductions keep apart (one AVX-512 register), so that they vectorize: a
/// running minimum is one chain of dependent instructions, which the compiler keeps scalar.
const LANES: usize = 16;

/// A row's smallest and largest values (either zero where both are), and whether every value
/// is finite.
#[inline(always)]
fn row_range(values: &[f32]) -> (f32, f32, bool) {
    let mut low = [f32::INFINITY; LANES];
    let mut high = [f32::NEG_INFINITY; LANES];
    // x - x is 0 for a finite x and NaN otherwise, and NaN stays NaN in a sum.
    let mut not_finite = [0.0f32; LANES];
    let mut take = |lane: usize, value: f32| {
        low[lane] = low[lane].min(value);
        high[lane] = high[lane].max(value);
        #[allow(clippy::eq_op)] // the point: NaN for infinities and NaN
        let zero_if_finite = value - value;
        not_finite[lane] += zero_if_finite;
    };
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &value) in chunk.iter().enumerate() {
            take(lane, value);
        }
    }
    for (lane, &value) in tail.iter().enumerate() {
        take(lane, value);
    }
    (
        low.into_iter().fold(f32::INFINITY, f32::min),
        high.into_iter().fold(f32::NEG_INFINITY, f32::max),
        not_finite.iter().all(|&sum| sum == 0.0),
    )
}

/// Rows one thread quantizes at a time in `quantize_rows`.
const ROWS_PER_PIECE: usize = 64;

/// Quantizes each row of `values` (`head_dim` f32s) into its row of `out` (`row_bytes(head_dim)`
/// bytes), on up to `threads` threads (the attention kernel's, `for_each_piece`).
pub fn quantize_rows(
    dtype: KvCacheDtype,
    values: &[f32],
    out: &mut [u8],
    head_dim: usize,
    threads: usize,
) -> CoreResult<()> {
    let row_bytes = match dtype.row_bytes(head_dim) {
        Some(row_bytes) if head_dim > 0 => row_bytes,
        _ => {
            return Err(invalid!(
                "quantize_rows needs a quantized dtype and a head_dim"
            ))
        }
    };
    ensure!(
        (1..=MAX_THREADS).contains(&threads),
        "threads must be 1 to {MAX_THREADS}, got {threads}"
    );
    let rows = values.len() / head_dim;
    ensure!(
        values.len() == rows * head_dim && Some(out.len()) == rows.checked_mul(row_bytes),
        "{} values and {} bytes are not the same rows of {head_dim} values and {row_bytes} bytes",
        values.len(),
        out.len()
    );
    let out = RowsOut(out.as_mut_ptr());
    let set = InstructionSet::detected();
    let quantize_piece = |piece: usize| {
        let first = piece * ROWS_PER_PIECE;
        let count = ROWS_PER_PIECE.min(rows - first);
        // Safety: pieces cover disjoint rows of `out`, which outlives the threads' work.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.at(first * row_bytes), count * row_bytes) };
        let values = &values[first * head_dim..(first + count) * head_dim];
        match set {
            // Safety: `detected` found their features on this CPU.
            #[cfg(target_arch = "x86_64")]
            InstructionSet::Avx512 => unsafe { quantize_avx512(dtype, values, bytes, head_dim) },
            #[cfg(target_arch = "x86_64")]
            InstructionSet::Avx2 => unsafe { quantize_avx2(dtype, values, bytes, head_dim) },
            _ => quantize_each(dtype, values, bytes, head_dim),
        }
    };
    for_each_piece(threads, rows.div_ceil(ROWS_PER_PIECE), &quantize_piece)
}

/// Each row of `values` into its row of `bytes`; inlined into one copy per instruction set,
/// so that the rows' loops run as wide as the CPU allows (SSE2's four lanes by default).
#[inline(always)]
fn quantize_each(dtype: KvCacheDtype, values: &[f32], bytes: &mut [u8], head_dim: usize) {
    let row_bytes = bytes.len() / (values.len() / head_dim);
    for (row, row_values) in bytes
        .chunks_exact_mut(row_bytes)
        .zip(values.chunks_exact(head_dim))
    {
        dtype.quantize_row(row_values, row);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn quantize_avx512(dtype: KvCacheDtype, values: &[f32], bytes: &mut [u8], head_dim: usize) {
    quantize_each(dtype, values, bytes, head_dim);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(dtype: KvCacheDtype, values: &[f32], bytes: &mut [u8], head_dim: usize) {
    quantize_each(dtype, values, bytes, head_dim);
}

/// `out`'s start, shared by the threads of `quantize_rows`, each writing rows of its own.
#[derive(Clone, Copy)]
struct RowsOut(*mut u8);

// Safety: the threads write disjoint rows (`quantize_rows`).
unsafe impl Send for RowsOut {}
unsafe impl Sync for RowsOut {}

impl RowsOut {
    fn at(self, offset: usize) -> *mut u8 {
        // Safety (for callers): `offset` is within the slice it came from.
        self.0.wrapping_add(offset)
    }
}

/// One quantized row format: `head_dim` one-byte codes followed by `TRAILER` bytes of scale.
///
/// A row whose values are not all finite is written with a NaN scale, so that reading it
/// gives NaN everywhere: a quantized cache cannot hide a bad value as a finite one.
pub trait RowFormat {
    /// Bytes after the codes.
    const TRAILER: usize;
    /// `row` is `values.len() + TRAILER` long.
    fn quantize(values: &[f32], row: &mut [u8]);
    /// `row` is `values.len() + TRAILER` long.
    fn dequantize(row: &[u8], values: &mut [f32]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_quantized_on_threads_are_the_rows_quantized_one_by_one() {
        let head_dim = 24;
        let values: Vec<f32> = (0..head_dim * 150)
            .map(|i| ((i * 37) % 101) as f32 - 50.5)
            .collect();
        for dtype in [KvCacheDtype::Int8, KvCacheDtype::Fp8E4m3] {
            let row_bytes = dtype.row_bytes(head_dim).unwrap();
            let mut one_by_one = vec![0u8; 150 * row_bytes];
            for (row, row_values) in one_by_one
                .chunks_exact_mut(row_bytes)
                .zip(values.chunks_exact(head_dim))
            {
                dtype.quantize_row(row_values, row);
            }
            for threads in [1, 2, 3] {
                let mut out = vec![0u8; 150 * row_bytes];
                quantize_rows(dtype, &values, &mut out, head_dim, threads).unwrap();
                assert_eq!(out, one_by_one, "{dtype:?} on {threads} threads");
            }
        }
    }

    #[test]
    fn quantize_rows_refuses_mismatched_sizes_and_writes_nothing() {
        let values = vec![1.0f32; 48];
        let mut out = vec![7u8; 2 * 28];
        for (dtype, head_dim, threads) in [
            (KvCacheDtype::Auto, 24, 1),
            (KvCacheDtype::Int8, 0, 1),
            (KvCacheDtype::Int8, 24, 0),
            (KvCacheDtype::Int8, 16, 1), // 3 rows of 16 need 60 bytes
        ] {
            assert!(quantize_rows(dtype, &values, &mut out, head_dim, threads).is_err());
            assert!(out.iter().all(|&byte| byte == 7));
        }
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for dtype in KvCacheDtype::ALL {
            assert_eq!(KvCacheDtype::parse(dtype.name()).unwrap(), dtype);
        }
        let error = KvCacheDtype::parse("int4").unwrap_err().to_string();
        assert!(
            error.contains("int4") && error.contains("fp8_e4m3"),
            "{error}"
        );
    }

    #[test]
    fn rows_take_head_dim_bytes_and_a_four_byte_trailer() {
        assert_eq!(KvCacheDtype::Int8.row_bytes(128), Some(132));
        assert_eq!(KvCacheDtype::Fp8E4m3.row_bytes(64), Some(68));
        assert_eq!(KvCacheDtype::Auto.row_bytes(128), None);
        assert_eq!(KvCacheDtype::Int8.row_bytes(usize::MAX), None);
    }

    #[test]
    fn a_row_with_a_non_finite_value_reads_back_as_nan() {
        for dtype in [KvCacheDtype::Int8, KvCacheDtype::Fp8E4m3] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let values = [1.0, bad, -2.0, 0.5];
                let mut row = vec![0u8; dtype.row_bytes(4).unwrap()];
                dtype.quantize_row(&values, &mut row);
                let mut back = [0.0f32; 4];
                dtype.dequantize_row(&row, &mut back);
                assert!(
                    back.iter().all(|value| value.is_nan()),
                    "{dtype:?} {back:?}"
                );
            }
        }
    }
}
