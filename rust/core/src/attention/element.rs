//! The element types K/V and queries are held in, and their conversion to and from the
//! `f32` the kernel computes in; a quantized cache's rows (`Int8Code`, `Fp8E4m3Code`:
//! `head_dim` codes and their scale) are read and written the same way, a row at a time.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::quant::{Fp8E4m3Rows, Int8Rows, RowFormat};

/// An element type of queries, K/V and outputs.
pub trait Element: Copy + Send + Sync + 'static {
    /// Converts `src` into `dst`: one row of `row_len(dst.len())` elements.
    fn load(src: &[Self], dst: &mut [f32]);
    /// Converts `src` into `dst` (one row of `row_len(src.len())`), rounding to nearest.
    fn store(src: &[f32], dst: &mut [Self]);

    /// Elements one row of `head_dim` values takes.
    #[inline(always)]
    fn row_len(head_dim: usize) -> usize {
        head_dim
    }

    /// `src` itself when it holds `f32`s: read in place, with no conversion.
    fn as_f32(_src: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Element for f32 {
    #[inline(always)]
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn as_f32(src: &[f32]) -> Option<&[f32]> {
        Some(src)
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn load(src: &[bf16], dst: &mut [f32]) {
        // A bfloat16 is the high half of an f32: a shift, which vectorizes.
        for (out, value) in dst.iter_mut().zip(src) {
            *out = f32::from_bits(u32::from(value.to_bits()) << 16);
        }
    }

    #[inline(always)]
    fn store(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Element for f16 {
    #[inline(always)]
    fn load(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    #[inline(always)]
    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// One byte of an int8-quantized cache row (`quant::Int8Rows`): a row is `head_dim` codes then
/// the row's scale and offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Int8Code(pub u8);

/// One byte of an fp8 E4M3-quantized cache row (`quant::Fp8E4m3Rows`): `head_dim` codes then
/// the row's scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Fp8E4m3Code(pub u8);

macro_rules! quantized_element {
    ($code:ident, $format:ident) => {
        impl $code {
            /// Rows of codes as the bytes they are.
            pub fn bytes(codes: &[$code]) -> &[u8] {
                // Safety: `repr(transparent)` over a `u8`.
                unsafe { std::slice::from_raw_parts(codes.as_ptr().cast::<u8>(), codes.len()) }
            }

            /// Bytes as rows of codes.
            pub fn from_bytes(bytes: &[u8]) -> &[$code] {
                // Safety: `repr(transparent)` over a `u8`; every byte is a code.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<$code>(), bytes.len()) }
            }

            fn bytes_mut(codes: &mut [$code]) -> &mut [u8] {
                // Safety: as `bytes`; borrowed mutably for the result's life.
                unsafe {
                    std::slice::from_raw_parts_mut(codes.as_mut_ptr().cast::<u8>(), codes.len())
                }
            }
        }

        impl Element for $code {
            #[inline(always)]
            fn load(src: &[$code], dst: &mut [f32]) {
                $format::dequantize($code::bytes(src), dst);
            }

            #[inline(always)]
            fn store(src: &[f32], dst: &mut [$code]) {
                $format::quantize(src, $code::bytes_mut(dst));
            }

            #[inline(always)]
            fn row_len(head_dim: usize) -> usize {
                head_dim + $format::TRAILER
            }
        }
    };
}

quantized_element!(Int8Code, Int8Rows);
quantized_element!(Fp8E4m3Code, Fp8E4m3Rows);
