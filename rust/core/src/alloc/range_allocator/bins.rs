//! Size classes: a small float of a range's size (5-bit exponent, 3-bit mantissa), so that
//! bins are at most 12.5% apart at every scale.

const MANTISSA_BITS: u32 = 3;
const MANTISSA_VALUE: u64 = 1 << MANTISSA_BITS;
const MANTISSA_MASK: u64 = MANTISSA_VALUE - 1;
pub(super) const NUM_TOP_BINS: usize = 64;
pub(super) const LEAF_BINS: usize = 8;
pub(super) const NUM_BINS: usize = NUM_TOP_BINS * LEAF_BINS;

/// (exponent, mantissa, whether bits below the mantissa were dropped) of `size` ≥ 8.
fn float_parts(size: u64) -> (u64, u64, bool) {
    let highest_bit = 63 - size.leading_zeros();
    let mantissa_start = highest_bit - MANTISSA_BITS;
    let exponent = (mantissa_start + 1) as u64;
    let mantissa = (size >> mantissa_start) & MANTISSA_MASK;
    (
        exponent,
        mantissa,
        size & ((1u64 << mantissa_start) - 1) != 0,
    )
}

/// The bin whose ranges are all at least `size`.
pub(super) fn bin_round_up(size: u64) -> usize {
    if size < MANTISSA_VALUE {
        return size as usize;
    }
    let (exponent, mantissa, inexact) = float_parts(size);
    // A mantissa overflow carries into the exponent, as it should.
    ((exponent << MANTISSA_BITS) + mantissa + u64::from(inexact)) as usize
}

/// The bin a free range of `size` belongs to: the largest whose lower bound is ≤ `size`.
pub(super) fn bin_round_down(size: u64) -> usize {
    if size < MANTISSA_VALUE {
        return size as usize;
    }
    let (exponent, mantissa, _) = float_parts(size);
    ((exponent << MANTISSA_BITS) | mantissa) as usize
}

/// Smallest size in `bin`.
#[cfg(test)]
pub(super) fn bin_lower_bound(bin: usize) -> u64 {
    let (exponent, mantissa) = ((bin as u64) >> MANTISSA_BITS, (bin as u64) & MANTISSA_MASK);
    if exponent == 0 {
        mantissa
    } else {
        (mantissa | MANTISSA_VALUE) << (exponent - 1)
    }
}
