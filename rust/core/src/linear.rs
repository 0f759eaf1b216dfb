//! A linear layer's product over a few rows (a decode step's): `out = x · weightᵀ`, the
//! weight read once, in place, in its own element type.
//!
//! A BLAS's matrix product packs the weight into its own layout on every call, which pays
//! off over many rows: over a few (2 rows, 768 × 256 floats) MKL took 70 µs on two Zen 3
//! cores, ~11 GB/s of weight, where reading it once runs at the cache's speed. Here each
//! piece takes a run of the weight's rows (output features), converts four at a time to
//! `f32` (bf16 and f16 weights are read as such: half the bytes) and takes their dot
//! products with every row of `x` while they sit in L1. Sums are `f32`, in lanes added at
//! the end, in an order that depends on nothing but the shapes: every thread count gives the
//! same bits.

use std::cell::RefCell;

use crate::attention::{for_each_piece, Element, InstructionSet, MAX_THREADS};
use crate::error::CoreResult;

/// Output features one piece computes (the unit of work handed to a thread).
const FEATURES_PER_PIECE: usize = 64;
/// Weight rows converted and dotted together.
const GROUP: usize = 4;
/// `f32`s per partial sum: one AVX2 register.
const LANES: usize = 8;

/// `out` (`[rows, features_out]`) = `x` (`[rows, features_in]`) times `weight`
/// (`[features_out, features_in]`) transposed, plus `bias` (`[features_out]`) when given, all
/// row-major; the bias is added to the `f32` sum, which is rounded once. `E` is `f32`, `bf16`
/// or `f16`: elements, not a quantized cache's rows of codes and a scale.
#[derive(Debug, Clone, Copy)]
pub struct Linear<'a, E> {
    pub x: &'a [E],
    pub weight: &'a [E],
    pub bias: Option<&'a [E]>,
    pub rows: usize,
    pub features_in: usize,
    pub features_out: usize,
}

/// Where a piece writes: each piece writes its own features of every row.
#[derive(Clone, Copy)]
struct Output<E>(*mut E);

// Pieces write disjoint columns of the output (see `run`).
unsafe impl<E: Send> Send for Output<E> {}
unsafe impl<E: Send> Sync for Output<E> {}

thread_local! {
    /// The calling thread's `x` in `f32` (when it is not), read by every thread of the call.
    static X: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Each thread's weight rows in `f32` (when they are not).
    static WEIGHTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl<E: Element> Linear<'_, E> {
    /// Computes the product into `out` on up to `threads` threads (torch's OpenMP team once
    /// `use_openmp` named it). Checks every size first: a bad call is an error and changes
    /// nothing.
    pub fn run(&self, out: &mut [E], threads: usize) -> CoreResult<()> {
        let (rows, inner, features) = (self.rows, self.features_in, self.features_out);
        ensure!(inner > 0, "features_in must be positive");
        ensure!(
            rows.checked_mul(inner) == Some(self.x.len()),
            "x has {} elements, not rows × features_in = {rows} × {inner}",
            self.x.len()
        );
        ensure!(
            features.checked_mul(inner) == Some(self.weight.len()),
            "the weight has {} elements, not features_out × features_in = {features} × {inner}",
            self.weight.len()
        );
        ensure!(
            rows.checked_mul(features) == Some(out.len()),
            "out has {} elements, not rows × features_out = {rows} × {features}",
            out.len()
        );
        if let Some(bias) = self.bias {
            ensure!(
                bias.len() == features,
                "the bias has {} elements, not features_out = {features}",
                bias.len()
            );
        }
        ensure!(
            (1..=MAX_THREADS).contains(&threads),
            "threads must be 1 to {MAX_THREADS}, got {threads}"
        );
        if rows == 0 || features == 0 {
            return Ok(());
        }
        let piece = match InstructionSet::detected() {
            #[cfg(target_arch = "x86_64")]
            InstructionSet::Avx512 => piece_avx512::<E>,
            #[cfg(target_arch = "x86_64")]
            InstructionSet::Avx2 => piece_avx2::<E>,
            _ => piece_portable::<E>,
        };
        let output = Output(out.as_mut_ptr());
        let pieces = features.div_ceil(FEATURES_PER_PIECE);
        X.with(|cell| {
            let mut converted = cell.borrow_mut();
            let x: &[f32] = match E::as_f32(self.x) {
                Some(x) => x,
                None => {
                    converted.resize(self.x.len(), 0.0);
                    E::load(self.x, &mut converted);
                    &converted
                }
            };
            let work = |index: usize| {
                let first = index * FEATURES_PER_PIECE;
                let end = (first + FEATURES_PER_PIECE).min(features);
                WEIGHTS.with(|cell| {
                    let mut converted = cell.borrow_mut();
                    converted.resize(GROUP * inner, 0.0);
                    // Safety: the sizes were checked; this piece alone writes features
                    // first..end.
                    unsafe { piece(self, x, &mut converted, (first, end), output) };
                });
            };
            for_each_piece(threads, pieces, &work)
        })
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn piece_avx512<E: Element>(
    call: &Linear<'_, E>,
    x: &[f32],
    converted: &mut [f32],
    features: (usize, usize),
    out: Output<E>,
) {
    compute(call, x, converted, features, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn piece_avx2<E: Element>(
    call: &Linear<'_, E>,
    x: &[f32],
    converted: &mut [f32],
    features: (usize, usize),
    out: Output<E>,
) {
    compute(call, x, converted, features, out);
}

unsafe fn piece_portable<E: Element>(
    call: &Linear<'_, E>,
    x: &[f32],
    converted: &mut [f32],
    features: (usize, usize),
    out: Output<E>,
) {
    compute(call, x, converted, features, out);
}

/// Features `first..end` of every row of `x` (the call's, in `f32`), into `out`; weight rows
/// that are not `f32` are converted into `converted` (`GROUP` rows).
///
/// # Safety
/// `out` is the call's checked output, and no other thread writes these features.
#[inline(always)]
unsafe fn compute<E: Element>(
    call: &Linear<'_, E>,
    x: &[f32],
    converted: &mut [f32],
    (first, end): (usize, usize),
    out: Output<E>,
) {
    let (inner, features) = (call.features_in, call.features_out);
    let mut sums = [[0.0f32; GROUP]; 2];
    for feature in (first..end).step_by(GROUP) {
        let count = GROUP.min(end - feature);
        // Past the run's end a group repeats its last row: computed, never written.
        let source = |j: usize| {
            let row = feature + j.min(count - 1);
            &call.weight[row * inner..(row + 1) * inner]
        };
        for j in 0..GROUP {
            if E::as_f32(source(j)).is_none() {
                E::load(source(j), &mut converted[j * inner..(j + 1) * inner]);
            }
        }
        let rows: [&[f32]; GROUP] = std::array::from_fn(|j| {
            E::as_f32(source(j)).unwrap_or(&converted[j * inner..(j + 1) * inner])
        });
        let mut biases = [0.0f32; GROUP];
        if let Some(bias) = call.bias {
            E::load(&bias[feature..feature + count], &mut biases[..count]);
        }
        let store = |row: usize, sums: &[f32; GROUP]| {
            let sums: [f32; GROUP] = std::array::from_fn(|j| sums[j] + biases[j]);
            let at = row * features + feature;
            // Safety: the caller's contract; these features of the row are this piece's.
            let target = unsafe { std::slice::from_raw_parts_mut(out.0.add(at), count) };
            E::store(&sums[..count], target);
        };
        let mut pairs = x.chunks_exact(2 * inner);
        for (pair, both) in (&mut pairs).enumerate() {
            let (first, second) = both.split_at(inner);
            dots([first, second], &rows, &mut sums);
            store(2 * pair, &sums[0]);
            store(2 * pair + 1, &sums[1]);
        }
        if !pairs.remainder().is_empty() {
            let mut last = [[0.0f32; GROUP]; 1];
            dots([pairs.remainder()], &rows, &mut last);
            store(x.len() / inner - 1, &last[0]);
        }
    }
}

/// The dot products of each of `xs` with each of `weights`' rows, in `LANES` partial sums
/// each (element `k` in lane `k % LANES`), added pairwise at the end: `X_ROWS` × `GROUP`
/// registers of sums, each weight load serving `X_ROWS` rows.
#[inline(always)]
fn dots<const X_ROWS: usize>(
    xs: [&[f32]; X_ROWS],
    weights: &[&[f32]; GROUP],
    sums: &mut [[f32; GROUP]; X_ROWS],
) {
    let inner = weights[0].len();
    let mut partial = [[[0.0f32; LANES]; GROUP]; X_ROWS];
    let whole = inner / LANES * LANES;
    for at in (0..whole).step_by(LANES) {
        for (j, row) in weights.iter().enumerate() {
            let ws = &row[at..at + LANES];
            for (partial, x) in partial.iter_mut().zip(&xs) {
                let xs = &x[at..at + LANES];
                for lane in 0..LANES {
                    partial[j][lane] = xs[lane].mul_add(ws[lane], partial[j][lane]);
                }
            }
        }
    }
    for at in whole..inner {
        for (j, row) in weights.iter().enumerate() {
            for (partial, x) in partial.iter_mut().zip(&xs) {
                partial[j][at - whole] = x[at].mul_add(row[at], partial[j][at - whole]);
            }
        }
    }
    for (sums, partial) in sums.iter_mut().zip(&partial) {
        for (sum, lanes) in sums.iter_mut().zip(partial) {
            let quads: [f32; 4] = std::array::from_fn(|i| lanes[i] + lanes[i + 4]);
            *sum = (quads[0] + quads[2]) + (quads[1] + quads[3]);
        }
    }
}
