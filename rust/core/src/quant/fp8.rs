//! fp8 E4M3 rows: each value `e4m3(code) * scale`, with the row's f32 scale in a four-byte
//! trailer.
//!
//! `e4m3fn` as vLLM, TensorRT-LLM and the H100's tensor cores read it: 4 exponent bits (bias
//! 7), 3 mantissa bits, no infinities, ±448 at most, one NaN pattern per sign (`0x7F`,
//! `0xFF`). The scale is the row's largest magnitude / 448, so the largest value takes the
//! largest code; every value then reads back within 1/16 of itself (half a mantissa step)
//! where it is normal, and within `scale / 1024` (half the subnormal quantum) below. The
//! conversion is integer arithmetic on the f32's bits, rounding to nearest even as the
//! hardware conversions do; reading is a table of the 256 codes, so no CPU feature is needed
//! for either.

use super::{row_range, RowFormat, ROUNDING};

/// The largest finite E4M3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// fp8 E4M3 rows with an f32 scale.
pub struct Fp8E4m3Rows;

impl Fp8E4m3Rows {
    /// The value of every code.
    pub const VALUES: [f32; 256] = e4m3_values();

    /// The trailer's scale of `row`.
    #[inline(always)]
    pub fn scale(row: &[u8]) -> f32 {
        let at = row.len() - Self::TRAILER;
        f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]])
    }

    /// The code nearest `value` (ties to the even code), saturating at ±448; NaN for NaN.
    /// Both ways of rounding (normal codes from the f32's bits, subnormal ones from the value
    /// times 2^9) are computed and one is chosen, without branches, so that a row's loop
    /// vectorizes.
    #[inline(always)]
    pub fn encode(value: f32) -> u8 {
        // i32 throughout: SSE2 has no unsigned conversion or minimum, which would keep the
        // loop from vectorizing.
        let bits = value.to_bits() as i32;
        let sign = ((bits >> 24) & 0x80) as u8;
        let magnitude_bits = bits & 0x7FFF_FFFF;
        let magnitude = f32::from_bits(magnitude_bits as u32);
        // Normal codes: the exponent rebiased (7 for 127) and the top three mantissa bits,
        // the rest rounded to nearest even; a carry out of the mantissa moves to the next
        // exponent, as it should. (Below 2^-6 this is computed and not chosen.)
        let truncated = ((magnitude_bits >> 20) - (120 << 3)) & 0xFFF;
        let rest = magnitude_bits & 0xF_FFFF;
        let up = i32::from(rest > 0x8_0000 || (rest == 0x8_0000 && truncated & 1 == 1));
        let normal = truncated + up;
        // Subnormal codes are multiples of 2^-9, and code 8 is 2^-6, the first normal one:
        // the scaled value rounded (ties to even, by adding and taking away 1.5 x 2^23) is the
        // code. (x * 512 is exact; the minimum keeps large values, not chosen, in range.)
        let subnormal = (magnitude.min(1.0) * 512.0 + ROUNDING) - ROUNDING;
        // Safety: an integer in 0..=512 (NaN and larger values were taken to 1.0 first).
        let subnormal = unsafe { subnormal.to_int_unchecked::<i32>() };
        let code = if magnitude_bits < 121 << 23 {
            subnormal
        } else {
            normal
        };
        let code = if magnitude >= FP8_E4M3_MAX {
            0x7E
        } else {
            code.min(0x7E)
        };
        let code = if magnitude.is_nan() { 0x7F } else { code };
        sign | code as u8
    }
}

impl RowFormat for Fp8E4m3Rows {
    const TRAILER: usize = 4;

    #[inline(always)]
    fn quantize(values: &[f32], row: &mut [u8]) {
        debug_assert_eq!(row.len(), values.len() + Self::TRAILER);
        let (low, high, finite) = row_range(values);
        // The largest magnitude (+0 for a row of zeros, whichever zero its bounds are).
        let largest = if values.is_empty() {
            0.0
        } else {
            (-low).max(high).abs()
        };
        let scale = if finite {
            largest / FP8_E4M3_MAX
        } else {
            f32::NAN
        };
        let at = values.len();
        row[at..].copy_from_slice(&scale.to_le_bytes());
        // A zero scale (a row of zeros, or of values under 448 times the smallest f32) writes
        // zeros; a NaN one, NaN codes.
        let inverse = if scale > 0.0 { 1.0 / scale } else { scale };
        if inverse.is_finite() || inverse.is_nan() {
            for (code, &value) in row[..at].iter_mut().zip(values) {
                *code = Self::encode(value * inverse);
            }
        } else {
            // A scale under 2^-128 has no f32 inverse: such rows divide.
            for (code, &value) in row[..at].iter_mut().zip(values) {
                *code = Self::encode(value / scale);
            }
        }
    }

    #[inline(always)]
    fn dequantize(row: &[u8], values: &mut [f32]) {
        debug_assert_eq!(row.len(), values.len() + Self::TRAILER);
        let scale = Self::scale(row);
        for (value, &code) in values.iter_mut().zip(row) {
            *value = Self::VALUES[usize::from(code)] * scale;
        }
    }
}

const fn e4m3_values() -> [f32; 256] {
    let mut values = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        let exponent = (code >> 3) & 0xF;
        let mantissa = code & 7;
        let magnitude = if code & 0x7F == 0x7F {
            f32::NAN
        } else if exponent == 0 {
            mantissa as f32 / 512.0
        } else {
            f32::from_bits((((exponent + 120) as u32) << 23) | ((mantissa as u32) << 20))
        };
        values[code] = if code & 0x80 != 0 {
            -magnitude
        } else {
            magnitude
        };
        code += 1;
    }
    values
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The nearest finite code by search over the table, ties to the even code.
    fn nearest(value: f32) -> u8 {
        let mut best = 0u8;
        for code in 0..=255u8 {
            let candidate = Fp8E4m3Rows::VALUES[usize::from(code)];
            if candidate.is_nan() || (candidate == 0.0 && code == 0x80) {
                continue;
            }
            let here = (f64::from(candidate) - f64::from(value)).abs();
            let held = (f64::from(Fp8E4m3Rows::VALUES[usize::from(best)]) - f64::from(value)).abs();
            if here < held || (here == held && code & 1 == 0 && best & 1 == 1) {
                best = code;
            }
        }
        best
    }

    #[test]
    fn the_table_is_e4m3fn() {
        let values = Fp8E4m3Rows::VALUES;
        assert_eq!(values[0x7E], 448.0);
        assert_eq!(values[0xFE], -448.0);
        assert_eq!(values[0x08], 2f32.powi(-6));
        assert_eq!(values[0x01], 2f32.powi(-9));
        assert_eq!(values[0x38], 1.0);
        assert!(values[0x7F].is_nan() && values[0xFF].is_nan());
    }

    #[test]
    fn every_code_encodes_to_itself() {
        for code in 0..=255u8 {
            let value = Fp8E4m3Rows::VALUES[usize::from(code)];
            if value.is_nan() {
                continue;
            }
            assert_eq!(
                Fp8E4m3Rows::VALUES[usize::from(Fp8E4m3Rows::encode(value))],
                value
            );
        }
    }

    #[test]
    fn every_halfway_point_and_its_neighbours_encode_to_the_nearest_code() {
        // Between each pair of adjacent codes (subnormal and normal), and a step either side.
        for code in 0..0x7Eu8 {
            let (low, high) = (
                Fp8E4m3Rows::VALUES[usize::from(code)],
                Fp8E4m3Rows::VALUES[usize::from(code) + 1],
            );
            let halfway = (low + high) / 2.0;
            for value in [halfway.next_down(), halfway, halfway.next_up()] {
                for signed in [value, -value] {
                    let (got, want) = (Fp8E4m3Rows::encode(signed), nearest(signed));
                    let value_of = |code: u8| Fp8E4m3Rows::VALUES[usize::from(code)];
                    assert_eq!(
                        value_of(got),
                        value_of(want),
                        "{signed}: {got:#x}, {want:#x}"
                    );
                }
            }
        }
    }

    proptest! {
        #[test]
        fn encoding_picks_the_nearest_code(value in -460.0f32..460.0) {
            let got = Fp8E4m3Rows::encode(value);
            let want = nearest(value);
            prop_assert_eq!(
                Fp8E4m3Rows::VALUES[usize::from(got)],
                Fp8E4m3Rows::VALUES[usize::from(want)],
                "{} -> {:#x}, nearest {:#x}", value, got, want
            );
        }

        #[test]
        fn values_read_back_within_the_stated_bound(
            values in prop::collection::vec(-1.0e4f32..1.0e4, 1..160),
        ) {
            check_bound(&values)?;
        }

        #[test]
        fn rows_of_any_scale_keep_the_bound(
            exponent in -140i32..120,
            units in prop::collection::vec(-1.0f32..1.0, 1..64),
        ) {
            let size = 2f32.powi(exponent);
            check_bound(&units.iter().map(|unit| unit * size).collect::<Vec<_>>())?;
        }
    }

    fn check_bound(values: &[f32]) -> Result<(), TestCaseError> {
        let mut row = vec![0u8; values.len() + Fp8E4m3Rows::TRAILER];
        Fp8E4m3Rows::quantize(values, &mut row);
        let mut back = vec![0.0; values.len()];
        Fp8E4m3Rows::dequantize(&row, &mut back);
        let scale = f64::from(Fp8E4m3Rows::scale(&row));
        for (&value, &read) in values.iter().zip(&back) {
            let value = f64::from(value);
            // f32's own rounding of tiny products: its subnormal quantum.
            let bound = (value.abs() / 16.0).max(scale / 1024.0) * (1.0 + 1.0e-6) + 2f64.powi(-149);
            prop_assert!(
                (value - f64::from(read)).abs() <= bound,
                "{value} -> {read}"
            );
        }
        Ok(())
    }

    #[test]
    fn ties_go_to_the_even_code_and_large_values_saturate() {
        // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39).
        assert_eq!(Fp8E4m3Rows::encode(1.0625), 0x38);
        assert_eq!(Fp8E4m3Rows::encode(1.1875), 0x3A);
        assert_eq!(Fp8E4m3Rows::encode(1.0e9), 0x7E);
        assert_eq!(Fp8E4m3Rows::encode(-500.0), 0xFE);
        assert_eq!(Fp8E4m3Rows::encode(2f32.powi(-10)), 0x00);
    }
}
