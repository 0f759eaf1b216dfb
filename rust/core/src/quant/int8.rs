//! int8 rows: each value `q * scale + offset`, `q` in `-128..=127`, with the row's scale and
//! offset as bfloat16 in a four-byte trailer.
//!
//! Asymmetric, as Ascend's C8 KV cache (a scale and an offset), per row rather than per
//! channel so that it needs no calibration. The offset puts the row's minimum on code -128
//! and its maximum on code 127, so codes are spent on the row's range, not on its distance
//! from zero. Bfloat16 keeps the trailer at four bytes (132 bytes for a 128-value row, 1.94x
//! the rows of a bfloat16 cache in the same memory) with f32's exponent range: the offset is
//! rounded first, and the scale is computed from the rounded offset and rounded up, so the
//! codes still cover the row and every value reads back within half a step of itself; the step
//! is the row's range / 255, grown by at most the offset's rounding (|offset| / 256) and the
//! scale's (1 / 128 of itself).

use half::bf16;

use super::{row_range, RowFormat, ROUNDING};

/// int8 rows with a bfloat16 scale and offset.
pub struct Int8Rows;

impl Int8Rows {
    /// The trailer's scale and offset of `row`.
    #[inline(always)]
    pub fn scale_and_offset(row: &[u8]) -> (f32, f32) {
        let at = row.len() - Self::TRAILER;
        let scale = bf16::from_le_bytes([row[at], row[at + 1]]);
        let offset = bf16::from_le_bytes([row[at + 2], row[at + 3]]);
        (scale.to_f32(), offset.to_f32())
    }

    /// The scale and offset `values` are written with.
    #[inline(always)]
    fn parameters(values: &[f32]) -> (bf16, bf16) {
        let (low, high, finite) = row_range(values);
        if values.is_empty() || !finite {
            return (bf16::NAN, bf16::NAN);
        }
        // In f64: a row spanning most of f32's range has no f32 difference. (+ 0.0: a zero
        // bound is +0, whichever zero the row's minimum or maximum was.)
        let (low, high) = (f64::from(low) + 0.0, f64::from(high) + 0.0);
        let target = low + (high - low) * 128.0 / 255.0;
        let offset = bf16::from_f64(target);
        let rounded = f64::from(offset.to_f32());
        let needed = ((rounded - low) / 128.0).max((high - rounded) / 127.0);
        let scale = round_up(needed);
        if !scale.to_f32().is_finite() {
            return (bf16::NAN, bf16::NAN);
        }
        (scale, offset)
    }
}

impl RowFormat for Int8Rows {
    const TRAILER: usize = 4;

    #[inline(always)]
    fn quantize(values: &[f32], row: &mut [u8]) {
        debug_assert_eq!(row.len(), values.len() + Self::TRAILER);
        let (scale, offset) = Self::parameters(values);
        let at = values.len();
        row[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        row[at + 2..at + 4].copy_from_slice(&offset.to_le_bytes());
        let (scale, offset) = (scale.to_f32(), offset.to_f32());
        let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        // A scale under 2^-128 has no f32 inverse: such rows divide.
        let divide = !inverse.is_finite();
        if divide {
            for (code, &value) in row[..at].iter_mut().zip(values) {
                *code = code_of((value - offset) / scale);
            }
        } else {
            for (code, &value) in row[..at].iter_mut().zip(values) {
                *code = code_of((value - offset) * inverse);
            }
        }
    }

    #[inline(always)]
    fn dequantize(row: &[u8], values: &mut [f32]) {
        debug_assert_eq!(row.len(), values.len() + Self::TRAILER);
        let (scale, offset) = Self::scale_and_offset(row);
        for (value, &code) in values.iter_mut().zip(row) {
            *value = f32::from(code as i8) * scale + offset;
        }
    }
}

/// The code of `units` (a value's distance from the offset in steps): the nearest integer,
/// ties to even, clamped to `-128..=127`. Clamped first, then rounded by adding and taking
/// away 1.5 x 2^23, where f32's step is 1: the same as rounding first, and it vectorizes
/// (`round_ties_even` is a libm call per value without SSE4.1: 7.6 against ~0.5 ns a value).
/// NaN (a row that is not all finite) becomes code 0; its NaN scale reads it back.
#[inline(always)]
fn code_of(units: f32) -> u8 {
    let clamped = units.clamp(-128.0, 127.0);
    let clamped = if clamped.is_nan() { 0.0 } else { clamped };
    let rounded = (clamped + ROUNDING) - ROUNDING;
    // Safety: an integer in -128..=127. (`as`, which saturates, would not vectorize.)
    (unsafe { rounded.to_int_unchecked::<i32>() }) as u8
}

/// The smallest bfloat16 at least `value` (a non-negative finite f64).
fn round_up(value: f64) -> bf16 {
    let nearest = bf16::from_f64(value);
    if f64::from(nearest.to_f32()) >= value {
        nearest
    } else {
        bf16::from_bits(nearest.to_bits() + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip(values: &[f32]) -> (Vec<f32>, f32, f32) {
        let mut row = vec![0u8; values.len() + Int8Rows::TRAILER];
        Int8Rows::quantize(values, &mut row);
        let mut back = vec![0.0; values.len()];
        Int8Rows::dequantize(&row, &mut back);
        let (scale, offset) = Int8Rows::scale_and_offset(&row);
        (back, scale, offset)
    }

    /// Every value within half the row's step (and the f32 rounding of reading it back), and
    /// the step at most the row's range / 255 grown by the roundings the module names.
    fn check_bounds(values: &[f32]) -> Result<(), TestCaseError> {
        let (back, scale, offset) = round_trip(values);
        let low = values.iter().copied().fold(f32::INFINITY, f32::min) as f64;
        let high = values.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let (scale, offset) = (f64::from(scale), f64::from(offset));
        let target = low + (high - low) * 128.0 / 255.0;
        let step_bound = ((high - low) / 255.0 + 2.0 * target.abs() / 256.0 / 255.0)
            * (1.0 + 1.0 / 128.0)
            // bfloat16's subnormal quantum, for rows of values under 2^-126.
            + 2f64.powi(-132);
        prop_assert!(scale <= step_bound, "step {scale} over {step_bound}");
        for (&value, &read) in values.iter().zip(&back) {
            let slack = 2.0 * f64::from(f32::EPSILON) * (f64::from(value).abs() + offset.abs());
            let error = (f64::from(value) - f64::from(read)).abs();
            prop_assert!(
                error <= scale / 2.0 + slack,
                "{value} read back as {read}: error {error}, step {scale}"
            );
        }
        Ok(())
    }

    #[test]
    fn codes_round_to_nearest_even_and_clamp_as_round_ties_even_does() {
        let reference = |units: f32| (units.round_ties_even().clamp(-128.0, 127.0) as i8) as u8;
        let mut units = vec![
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1e30,
            -1e30,
        ];
        for whole in -140..=140 {
            for fraction in [-0.5f32, -0.49999997, 0.0, 0.49999997, 0.5, 0.50000006] {
                units.push(whole as f32 + fraction);
            }
        }
        units.extend([
            4_194_303.5,
            -4_194_304.5,
            8_388_609.0,
            f32::MIN_POSITIVE,
            1.0e-45,
        ]);
        for value in units {
            assert_eq!(code_of(value), reference(value), "{value}");
        }
    }

    proptest! {
        #[test]
        fn values_read_back_within_half_a_step(
            values in prop::collection::vec(-1.0e3f32..1.0e3, 1..160),
        ) {
            check_bounds(&values)?;
        }

        #[test]
        fn rows_far_from_zero_and_of_any_scale_keep_the_bound(
            centre in -1.0e6f32..1.0e6,
            spread in 1.0e-6f32..1.0e3,
            units in prop::collection::vec(-1.0f32..1.0, 1..140),
        ) {
            let values: Vec<f32> = units.iter().map(|unit| centre + spread * unit).collect();
            check_bounds(&values)?;
        }

        #[test]
        fn a_row_depends_on_its_own_values_alone(
            values in prop::collection::vec(-50.0f32..50.0, 1..64),
        ) {
            let mut first = vec![0u8; values.len() + Int8Rows::TRAILER];
            let mut second = vec![0xAAu8; values.len() + Int8Rows::TRAILER];
            Int8Rows::quantize(&values, &mut first);
            Int8Rows::quantize(&values, &mut second);
            prop_assert_eq!(first, second);
        }
    }

    #[test]
    fn extreme_rows_keep_the_bound() {
        for values in [
            vec![0.0f32; 8],
            vec![3.0e38, -3.0e38, 1.0],
            vec![1.0001, 1.0001],
            vec![f32::MIN_POSITIVE, -f32::MIN_POSITIVE],
            vec![1.0e-40, 0.0, -1.0e-41],
            vec![65504.0, 65503.0, 65505.5],
        ] {
            check_bounds(&values).unwrap();
        }
    }
}
