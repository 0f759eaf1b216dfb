//! The arithmetic of the kernel over `f32` slices, written as independent lanes so that the
//! compiler turns each loop into vector instructions of whatever width the function it is
//! inlined into was compiled for (AVX-512, AVX2 or the portable baseline; see `dispatch`).
//! A sum over lanes is kept in `LANES` partial sums: the compiler may not reorder float
//! additions, but it vectorizes independent ones.

const LANES: usize = 16;

/// `a · b` (as long): lane-parallel partial sums, added in order at the end. Added as a
/// tree, the partial sums led LLVM to split the whole loop into 2-lane pieces (a quarter of
/// AVX-512's width): a decode's scores took 20% longer.
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut partial = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (a_tail, b_tail) = (a_chunks.remainder(), b_chunks.remainder());
    for (a, b) in a_chunks.zip(b_chunks) {
        for lane in 0..LANES {
            partial[lane] = a[lane].mul_add(b[lane], partial[lane]);
        }
    }
    let mut sum = partial.iter().sum::<f32>();
    for (a, b) in a_tail.iter().zip(b_tail) {
        sum = a.mul_add(*b, sum);
    }
    sum
}

/// The largest of `values` (`-inf` for none), in lane-parallel partial maxima: one
/// running maximum is a chain of dependent instructions, as slow per element as an `exp`.
#[inline(always)]
pub(super) fn max(values: &[f32]) -> f32 {
    let mut partial = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for lane in 0..LANES {
            partial[lane] = partial[lane].max(chunk[lane]);
        }
    }
    let mut width = LANES / 2;
    while width > 0 {
        for lane in 0..width {
            partial[lane] = partial[lane].max(partial[lane + width]);
        }
        width /= 2;
    }
    tail.iter().fold(partial[0], |max, &value| max.max(value))
}

/// `acc += weight × values`.
#[inline(always)]
pub(super) fn add_scaled(acc: &mut [f32], weight: f32, values: &[f32]) {
    for (acc, value) in acc.iter_mut().zip(values) {
        *acc = weight.mul_add(*value, *acc);
    }
}

/// `values *= factor`.
#[inline(always)]
pub(super) fn scale(values: &mut [f32], factor: f32) {
    for value in values {
        *value *= factor;
    }
}

/// `values[i] = exp(values[i] - max)`, returning their sum. A lane-parallel exponential
/// (Cephes' polynomial after reduction by ln 2: within 2 ulp over the range softmax
/// needs); arguments below -87 give 0.
#[inline(always)]
pub(super) fn exp_shifted_sum(values: &mut [f32], max: f32) -> f32 {
    let mut partial = [0.0f32; LANES];
    let mut chunks = values.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for lane in 0..LANES {
            chunk[lane] = exp(chunk[lane] - max);
            partial[lane] += chunk[lane];
        }
    }
    let mut sum = partial.iter().sum::<f32>();
    for value in chunks.into_remainder() {
        *value = exp(*value - max);
        sum += *value;
    }
    sum
}

/// `e^x` for `x <= 0` (what softmax feeds it), branch-free and in float and `u32`
/// arithmetic only, so that it vectorizes: `round` and a float-to-int cast would not (LLVM
/// left this scalar when it had them).
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 × 2^23: adding it rounds to an integer held in the mantissa's low bits.
    const ROUNDER: f32 = 12_582_912.0;
    // Below this e^x is about f32's smallest normal: 0 (-inf too). NaN is not below it and
    // passes the clamp, so it comes out NaN: a poisoned score poisons the output.
    let underflow = x < -87.0;
    let x = x.clamp(-87.0, 0.0);
    let shifted = x.mul_add(LOG2_E, ROUNDER);
    let n = shifted - ROUNDER;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = 1.987_569_1e-4_f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let poly = (p * r).mul_add(r, r) + 1.0;
    // 2^n: n + 127 in the exponent field. `shifted`'s bits are ROUNDER's plus n, and
    // ROUNDER's bits vanish in the shift (their low nine are zero).
    let two_to_n = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    if underflow {
        0.0
    } else {
        poly * two_to_n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_fp32_rounding_of_std() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (got, want) = (exp(x), x.exp());
            assert!(
                (got - want).abs() <= want * 4.0 * f32::EPSILON,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn dot_matches_the_plain_loop() {
        for len in [0, 1, 15, 16, 17, 64, 100, 128, 257] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
            assert!((f64::from(dot(&a, &b)) - want).abs() < 1e-4, "len {len}");
        }
    }

    #[test]
    fn max_matches_the_plain_fold() {
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        for len in [1, 15, 16, 17, 64, 100, 257] {
            let a: Vec<f32> = (0..len)
                .map(|i| (i as f32 * 0.37).sin() * i as f32)
                .collect();
            let want = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&a), want, "len {len}");
        }
    }

    #[test]
    fn exp_sums_match_the_plain_loop() {
        for len in [0, 1, 15, 16, 17, 64, 100, 128, 257] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut e = a.clone();
            let sum = exp_shifted_sum(&mut e, 1.0);
            let want_sum: f32 = a.iter().map(|x| (x - 1.0).exp()).sum();
            assert!(
                (sum - want_sum).abs() < 1e-4 * want_sum.max(1.0),
                "len {len}"
            );
        }
    }
}
