//! The arithmetic of the kernel over `f32` slices, written as independent lanes so that the
//! compiler turns each loop into vector instructions of whatever width the function it is
//! inlined into was compiled for (AVX-512, AVX2 or the portable baseline; see `dispatch`).
//! A sum over lanes is kept in `LANES` partial sums: the compiler may not reorder float
//! additions, but it vectorizes independent ones. A decode's scores (`KeyScores`) are the
//! exception: named AVX-512 instructions in that copy, where LLVM's lanes fell short.

/// `f32`s per register: AVX-512's sixteen (AVX2 and the portable code take two or four
/// registers for as many).
pub(super) const LANES: usize = 16;

/// `a · b` (as long): lane-parallel partial sums, added in order at the end (added as a
/// tree, they led LLVM to split the whole loop into 2-lane pieces).
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    lane_products(a, b).iter().sum::<f32>()
}

/// `a · b` (as long) left in `LANES` partial sums, lane `l` holding the products of the
/// elements `l`, `l + LANES`, ...: what `dot` adds up.
#[inline(always)]
pub(super) fn lane_products(a: &[f32], b: &[f32]) -> [f32; LANES] {
    let mut partial = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (a_tail, b_tail) = (a_chunks.remainder(), b_chunks.remainder());
    for (a, b) in a_chunks.zip(b_chunks) {
        for lane in 0..LANES {
            partial[lane] = a[lane].mul_add(b[lane], partial[lane]);
        }
    }
    for (lane, (a, b)) in a_tail.iter().zip(b_tail).enumerate() {
        partial[lane] = a.mul_add(*b, partial[lane]);
    }
    partial
}

/// A decode's scores, sixteen keys at a time: per query vector and key, the products left
/// in a register's lanes (`lane_products`), then sixteen keys' lanes added up at once
/// (`row_sums`). A sum per key is a chain of dependent additions and lane extractions (a
/// decode spent a fifth of its time there); sixteen at once are a butterfly of sixteen-lane
/// additions. Each instruction set's copy of the kernel names its own (`dispatch`).
///
/// # Safety
/// An implementor's methods may use instructions of its own set: call them only where the
/// CPU has it (`dispatch` names each set in the copy compiled for it, after detection).
pub(super) unsafe trait KeyScores {
    /// Whether a prefill's register tiles span two lane blocks (`lane_tile`): with 32
    /// registers of 16 lanes they take 8; with 16 of 8 (AVX2) they would take all 16 and
    /// spill, so each block is a tile of its own there.
    const PAIRED_TILES: bool;
    /// `lane_products(a, b)`.
    ///
    /// # Safety
    /// The CPU has the implementor's instruction set.
    unsafe fn lane_products(a: &[f32], b: &[f32]) -> [f32; LANES];
    /// `out[j] = Σ rows[j]`.
    ///
    /// # Safety
    /// As `lane_products`.
    unsafe fn row_sums(rows: &[[f32; LANES]; LANES]) -> [f32; LANES];
}

/// Plain loops, each row's lanes added in order, as `dot` does (any CPU).
pub(super) struct Portable;

// Safety: plain Rust, any CPU.
unsafe impl KeyScores for Portable {
    const PAIRED_TILES: bool = false;

    #[inline(always)]
    unsafe fn lane_products(a: &[f32], b: &[f32]) -> [f32; LANES] {
        lane_products(a, b)
    }

    #[inline(always)]
    unsafe fn row_sums(rows: &[[f32; LANES]; LANES]) -> [f32; LANES] {
        std::array::from_fn(|j| rows[j].iter().sum::<f32>())
    }
}

/// AVX-512 instructions, named: one register per key's products (LLVM split `lane_products`'
/// sixteen lanes into registers of 8, 4, 2 and 2 here), and four levels of shuffles and
/// additions, each halving the partial sums per row and doubling the rows per register.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512;

// Safety: AVX-512F instructions only, which the caller's CPU has (the trait's contract).
#[cfg(target_arch = "x86_64")]
unsafe impl KeyScores for Avx512 {
    const PAIRED_TILES: bool = true;

    #[inline(always)]
    unsafe fn lane_products(a: &[f32], b: &[f32]) -> [f32; LANES] {
        lane_products_avx512(a, b)
    }

    #[inline(always)]
    unsafe fn row_sums(rows: &[[f32; LANES]; LANES]) -> [f32; LANES] {
        butterfly(rows)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn lane_products_avx512(a: &[f32], b: &[f32]) -> [f32; LANES] {
    use std::arch::x86_64::*;
    let len = a.len().min(b.len());
    // One chain of multiply-adds, as the portable loop's lanes (two chains measured slower).
    let mut sums = _mm512_setzero_ps();
    let mut at = 0;
    while at + LANES <= len {
        let (x, y) = (
            _mm512_loadu_ps(a[at..].as_ptr()),
            _mm512_loadu_ps(b[at..].as_ptr()),
        );
        sums = _mm512_fmadd_ps(x, y, sums);
        at += LANES;
    }
    if at < len {
        // The tail's lanes only: a masked load reads nothing past the slices.
        let mask: __mmask16 = (1u16 << (len - at)) - 1;
        let x = _mm512_maskz_loadu_ps(mask, a[at..].as_ptr());
        let y = _mm512_maskz_loadu_ps(mask, b[at..].as_ptr());
        sums = _mm512_fmadd_ps(x, y, sums);
    }
    let mut out = [0.0f32; LANES];
    _mm512_storeu_ps(out.as_mut_ptr(), sums);
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn butterfly(rows: &[[f32; LANES]; LANES]) -> [f32; LANES] {
    use std::arch::x86_64::*;
    // Level 1: rows 2i and 2i + 1, their halves added: lanes 0..8 row 2i's, 8..16 row 2i + 1's.
    let halves: [__m512; 8] = std::array::from_fn(|i| {
        let (x, y) = (
            _mm512_loadu_ps(rows[2 * i].as_ptr()),
            _mm512_loadu_ps(rows[2 * i + 1].as_ptr()),
        );
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x, y),
            _mm512_shuffle_f32x4::<0xEE>(x, y),
        )
    });
    // Level 2: quarter q of register i holds row 4i + q's four partial sums.
    let quarters: [__m512; 4] = std::array::from_fn(|i| {
        let (x, y) = (halves[2 * i], halves[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        )
    });
    // Level 3: in quarter q, lanes 0..2 row 8i + q's two sums, lanes 2..4 row 8i + 4 + q's.
    let pairs: [__m512; 2] = std::array::from_fn(|i| {
        let (x, y) = (quarters[2 * i], quarters[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        )
    });
    // Level 4: lane 4q + t is row 4t + q's sum; one permutation puts row j in lane j.
    let (x, y) = (pairs[0], pairs[1]);
    let sums = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(x, y),
        _mm512_shuffle_ps::<0xDD>(x, y),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let mut out = [0.0f32; LANES];
    _mm512_storeu_ps(out.as_mut_ptr(), _mm512_permutexvar_ps(order, sums));
    out
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
    fn row_sums_add_each_row() {
        let rows: [[f32; LANES]; LANES] = std::array::from_fn(|j| {
            std::array::from_fn(|l| ((j * LANES + l) as f32 * 0.731).sin() * (1 + j) as f32)
        });
        let want: [f32; LANES] = std::array::from_fn(|j| rows[j].iter().sum::<f32>());
        // Sums in another order: within a few roundings of each row's magnitude.
        let check = |got: [f32; LANES], how: &str| {
            for j in 0..LANES {
                let size: f32 = rows[j].iter().map(|value| value.abs()).sum();
                assert!(
                    (got[j] - want[j]).abs() <= 4.0 * f32::EPSILON * size,
                    "{how}: row {j}"
                );
            }
        };
        // Safety: the portable set runs anywhere; AVX-512 only where detected.
        check(unsafe { Portable::row_sums(&rows) }, "in order");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            check(unsafe { Avx512::row_sums(&rows) }, "butterfly");
            // A NaN stays in its own row.
            let mut poisoned = rows;
            poisoned[5][9] = f32::NAN;
            let got = unsafe { Avx512::row_sums(&poisoned) };
            assert!(got[5].is_nan());
            let clean = unsafe { Avx512::row_sums(&rows) };
            assert!((0..LANES).filter(|&j| j != 5).all(|j| got[j] == clean[j]));
        }
    }

    #[test]
    fn lane_products_match_the_plain_loop() {
        for len in [0, 1, 15, 16, 17, 64, 100, 128, 257] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let want = lane_products(&a, &b);
            // Safety: the portable set runs anywhere; AVX-512 only where detected.
            assert_eq!(
                unsafe { Portable::lane_products(&a, &b) },
                want,
                "len {len}"
            );
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                // The same fused multiply-adds in the same order per lane: equal values.
                assert_eq!(unsafe { Avx512::lane_products(&a, &b) }, want, "len {len}");
            }
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
