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
