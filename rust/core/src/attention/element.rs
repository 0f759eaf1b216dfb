//! The element types K/V and queries are held in, and their conversion to and from the
//! `f32` the kernel computes in.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// An element type of queries, K/V and outputs.
pub trait Element: Copy + Send + Sync + 'static {
    /// Converts `src` into `dst` (as long).
    fn load(src: &[Self], dst: &mut [f32]);
    /// Converts `src` into `dst` (as long), rounding to nearest.
    fn store(src: &[f32], dst: &mut [Self]);

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
