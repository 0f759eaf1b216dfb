//! The kernel's path for many query vectors (prefill tiles): sixteen query vectors side by
//! side in the lanes of a vector register, transposed once per tile, and K and V read as
//! the cache holds them, a row per key.
//!
//! Scores are then `[key, lane]`: one vector's scores run down a column, so the softmax's
//! maximum, exponentials and sums are plain lane-wise operations over rows (no horizontal
//! reduction, no per-vector loop), and the causal and window masks a lane-wise comparison
//! of each lane's visible positions with the key's. Both products are register tiles of two
//! lane blocks (32 vectors) × four broadcast elements of K or V: per step two loads and
//! four broadcasts feed eight multiply-adds, and K is never transposed (the quad path
//! transposes it once per span and tile). Where registers hold 8 lanes (AVX2), two blocks'
//! sums would fill all 16 registers and spill: there a tile is one block
//! (`KeyScores::PAIRED_TILES`).

use super::element::Element;
use super::item::{load_span, write_out, Output, Place, Scratch, SPAN};
pub(super) use super::lanes::LANES;
use super::lanes::{exp, KeyScores};
use super::PagedAttention;

/// Lane blocks a register tile spans.
pub(super) const PAIR: usize = 2 * LANES;
/// Keys (scores) or dims (the weighted sum of V) per register tile.
const STEP: usize = 4;

/// Attends the item at `place` (at least `LANES` vectors), writing its tokens' heads.
///
/// # Safety
/// As `kernel::attend`'s.
#[inline(always)]
pub(super) unsafe fn attend<E: Element, C: Element, S: KeyScores>(
    call: &PagedAttention<'_, E, C>,
    place: &Place,
    table: &[i32],
    scratch: &mut Scratch,
    out: Output<E>,
) {
    let dim = call.shape.head_dim;
    let padded = place.vectors.next_multiple_of(PAIR);
    load_queries(call, place, scratch);
    let (lowest, highest) = place.keys(call.visibility);
    for first_key in (lowest..=highest).step_by(SPAN) {
        let end_key = (first_key + SPAN).min(highest + 1);
        let (loaded, whole) = (
            end_key - first_key,
            (end_key - first_key).next_multiple_of(STEP),
        );
        let in_place = span_rows(call, scratch, table, (first_key, end_key), place);
        // Keys past the span's last are scored and summed with weight 0: they read the
        // last key's row, finite whatever lies beyond it.
        let last = scratch.offsets[loaded - 1];
        scratch.offsets[loaded..whole].fill(last);
        let (keys_in, values_in) = in_place.unwrap_or((&scratch.keys_t, &scratch.values));
        for pair in (0..padded).step_by(PAIR) {
            let seen = &scratch.seen[pair..pair + PAIR];
            let Some(key_range) = keys_seen(seen, (first_key, end_key)) else {
                continue;
            };
            let rows = Rows {
                data: keys_in,
                offsets: &scratch.offsets,
                dim,
            };
            let queries = &scratch.queries[pair * dim..(pair + PAIR) * dim];
            if S::PAIRED_TILES {
                score_pair(queries, rows, key_range, &mut scratch.scores);
            } else {
                let (low, high) = queries.split_at(dim * LANES);
                score_block::<0>(low, rows, key_range, &mut scratch.scores);
                score_block::<LANES>(high, rows, key_range, &mut scratch.scores);
            }
            let state = Softmax {
                seen,
                max: &mut scratch.max[pair..pair + PAIR],
                sum: &mut scratch.sum[pair..pair + PAIR],
                acc: &mut scratch.acc[pair * dim..(pair + PAIR) * dim],
            };
            softmax_pair(state, &mut scratch.scores, first_key, key_range, dim);
            let acc = &mut scratch.acc[pair * dim..(pair + PAIR) * dim];
            let rows = Rows {
                data: values_in,
                ..rows
            };
            if S::PAIRED_TILES {
                accumulate_pair(acc, &scratch.scores, rows, key_range);
            } else {
                let (low, high) = acc.split_at_mut(dim * LANES);
                accumulate_block::<0>(low, &scratch.scores, rows, key_range);
                accumulate_block::<LANES>(high, &scratch.scores, rows, key_range);
            }
        }
    }
    // Back to a row per vector, as `write_out` reads the sums.
    for i in 0..place.vectors {
        let (block, lane) = (i / LANES * LANES, i % LANES);
        for d in 0..dim {
            scratch.queries[i * dim + d] = scratch.acc[block * dim + d * LANES + lane];
        }
    }
    std::mem::swap(&mut scratch.queries, &mut scratch.acc);
    write_out(call, place, scratch, out);
}

/// The keys of the span `first_key..end_key` that any lane of `seen` sees, as indices into
/// the span widened to whole `STEP`s (the lanes' masks drop what the widening adds).
#[inline(always)]
fn keys_seen(seen: &[(u32, u32)], (first_key, end_key): (usize, usize)) -> Option<(usize, usize)> {
    let from = seen.iter().map(|&(first, _)| first).min()? as usize;
    let to = seen.iter().map(|&(_, last)| last as usize + 1).max()?;
    let (from, to) = (from.max(first_key), to.min(end_key));
    (from < to).then(|| {
        (
            (from - first_key) / STEP * STEP,
            (to - first_key).next_multiple_of(STEP),
        )
    })
}

/// Loads the item's queries, pre-scaled, transposed per lane block (`[dim, LANES]`), each
/// lane's visible positions, and starts its softmax state.
#[inline(always)]
fn load_queries<E: Element, C>(
    call: &PagedAttention<'_, E, C>,
    place: &Place,
    scratch: &mut Scratch,
) {
    let (dim, vectors) = (call.shape.head_dim, place.vectors);
    let padded = vectors.next_multiple_of(PAIR);
    for i in 0..vectors {
        let (token, head) = place.vector(i);
        let at = (token * call.shape.num_heads + head) * dim;
        E::load(&call.query[at..at + dim], &mut scratch.row);
        let (block, lane) = (i / LANES * LANES, i % LANES);
        for (d, &value) in scratch.row.iter().enumerate() {
            scratch.queries[block * dim + d * LANES + lane] = value * call.scale;
        }
        let position = place.position(token);
        let first = call.visibility.first_visible(position);
        scratch.seen[i] = (first as u32, position as u32);
    }
    for i in vectors..padded {
        let (block, lane) = (i / LANES * LANES, i % LANES);
        for d in 0..dim {
            scratch.queries[block * dim + d * LANES + lane] = 0.0;
        }
        // Padding lanes see no key: every score of theirs is masked.
        scratch.seen[i] = (u32::MAX, 0);
    }
    scratch.acc[..padded * dim].fill(0.0);
    scratch.max[..padded].fill(f32::NEG_INFINITY);
    scratch.sum[..padded].fill(0.0);
}

/// The K or V rows of a span: key `k`'s is `data[offsets[k]..][..dim]`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    offsets: &'a [usize],
    dim: usize,
}

impl Rows<'_> {
    #[inline(always)]
    fn row(&self, key: usize) -> &[f32] {
        &self.data[self.offsets[key]..][..self.dim]
    }
}

/// Points `scratch.offsets` at the rows of the span's keys `first_key..end_key`: in the
/// caches themselves when they hold `f32` (returned: no copy), else in `keys_t` and
/// `values`, converted there (`None`).
#[inline(always)]
fn span_rows<'a, E, C: Element>(
    call: &PagedAttention<'a, E, C>,
    scratch: &mut Scratch,
    table: &[i32],
    (first_key, end_key): (usize, usize),
    place: &Place,
) -> Option<(&'a [f32], &'a [f32])> {
    let shape = &call.shape;
    let (dim, block_size) = (shape.head_dim, shape.block_size);
    let in_place = C::as_f32(call.key_cache).zip(C::as_f32(call.value_cache));
    if in_place.is_none() {
        load_span(
            call,
            scratch,
            table,
            (first_key, end_key, place.keys(call.visibility).1 + 1),
            place.kv_head,
            true,
        );
        for (key, offset) in scratch.offsets[..end_key - first_key]
            .iter_mut()
            .enumerate()
        {
            *offset = key * dim;
        }
        return None;
    }
    let (mut block, mut offset) = (first_key / block_size, first_key % block_size);
    for row in &mut scratch.offsets[..end_key - first_key] {
        let slot = table[block] as usize * block_size + offset;
        *row = (slot * shape.num_kv_heads + place.kv_head) * dim;
        offset += 1;
        if offset == block_size {
            (block, offset) = (block + 1, 0);
        }
    }
    in_place
}

/// The scores of a pair of lane blocks (`queries`, `[2, dim, LANES]`) over the span's keys
/// `first..end` (`keys`), into `scores` (`[SPAN, 2, LANES]`).
#[inline(always)]
fn score_pair(queries: &[f32], keys: Rows<'_>, (first, end): (usize, usize), scores: &mut [f32]) {
    let (low_block, high_block) = queries.split_at(keys.dim * LANES);
    for key in (first..end).step_by(STEP) {
        let [k0, k1, k2, k3]: [&[f32]; STEP] = std::array::from_fn(|j| keys.row(key + j));
        let mut low = [[0.0f32; LANES]; STEP];
        let mut high = [[0.0f32; LANES]; STEP];
        let columns = lane_arrays::<LANES>(low_block).zip(lane_arrays::<LANES>(high_block));
        let elements = k0.iter().zip(k1).zip(k2).zip(k3);
        for ((column_low, column_high), (((&a, &b), &c), &d)) in columns.zip(elements) {
            for (j, k) in [a, b, c, d].into_iter().enumerate() {
                for lane in 0..LANES {
                    low[j][lane] = k.mul_add(column_low[lane], low[j][lane]);
                    high[j][lane] = k.mul_add(column_high[lane], high[j][lane]);
                }
            }
        }
        let rows = scores[key * PAIR..(key + STEP) * PAIR].chunks_exact_mut(PAIR);
        for (j, row) in rows.enumerate() {
            row[..LANES].copy_from_slice(&low[j]);
            row[LANES..].copy_from_slice(&high[j]);
        }
    }
}

/// `score_pair` for one lane block (`queries`, `[dim, LANES]`), into the lanes
/// `HALF..HALF + LANES` of each score row: four keys' sums are eight AVX2 registers.
#[inline(always)]
fn score_block<const HALF: usize>(
    queries: &[f32],
    keys: Rows<'_>,
    (first, end): (usize, usize),
    scores: &mut [f32],
) {
    for key in (first..end).step_by(STEP) {
        let [k0, k1, k2, k3]: [&[f32]; STEP] = std::array::from_fn(|j| keys.row(key + j));
        let mut sums = [[0.0f32; LANES]; STEP];
        let elements = k0.iter().zip(k1).zip(k2).zip(k3);
        for (column, (((&a, &b), &c), &d)) in lane_arrays::<LANES>(queries).zip(elements) {
            for (j, k) in [a, b, c, d].into_iter().enumerate() {
                for lane in 0..LANES {
                    sums[j][lane] = k.mul_add(column[lane], sums[j][lane]);
                }
            }
        }
        for (j, sum) in sums.iter().enumerate() {
            scores[(key + j) * PAIR + HALF..][..LANES].copy_from_slice(sum);
        }
    }
}

/// A pair of lane blocks' softmax state: each lane's visible positions, maximum, sum, and
/// weighted sum of V (`[2, dim, LANES]`).
struct Softmax<'a> {
    seen: &'a [(u32, u32)],
    max: &'a mut [f32],
    sum: &'a mut [f32],
    acc: &'a mut [f32],
}

/// Turns the pair's scores over `key_range` (span indices from `first_key`) into softmax
/// weights, masking what each lane does not see, and rescales the lanes' sums whose
/// maximum grows.
#[inline(always)]
fn softmax_pair(
    state: Softmax<'_>,
    scores: &mut [f32],
    first_key: usize,
    (first, end): (usize, usize),
    dim: usize,
) {
    for half in [0, LANES] {
        let seen: &[(u32, u32); LANES] = state.seen[half..half + LANES].try_into().unwrap();
        // A block that sees all of these keys needs no mask (most blocks of most spans).
        let masked = seen.iter().any(|&(low, high)| {
            low as usize > first_key + first || (high as usize) < first_key + end - 1
        });
        let mut span_max = [f32::NEG_INFINITY; LANES];
        for key in first..end {
            let scores: &mut [f32; LANES] = (&mut scores[key * PAIR + half..][..LANES])
                .try_into()
                .unwrap();
            if masked {
                let position = (first_key + key) as u32;
                for lane in 0..LANES {
                    let (low, high) = seen[lane];
                    if position < low || position > high {
                        scores[lane] = f32::NEG_INFINITY;
                    }
                }
            }
            for lane in 0..LANES {
                span_max[lane] = span_max[lane].max(scores[lane]);
            }
        }
        let max: &mut [f32; LANES] = (&mut state.max[half..half + LANES]).try_into().unwrap();
        let mut shift = [0.0f32; LANES];
        let mut factor = [1.0f32; LANES];
        for lane in 0..LANES {
            let grown = max[lane].max(span_max[lane]);
            // A lane that has seen nothing yet keeps weights of exp(-inf) = 0.
            let none = grown == f32::NEG_INFINITY;
            shift[lane] = if none { 0.0 } else { grown };
            factor[lane] = if none { 1.0 } else { exp(max[lane] - grown) };
            max[lane] = grown;
        }
        let mut span_sum = [0.0f32; LANES];
        for key in first..end {
            let weights = &mut scores[key * PAIR + half..][..LANES];
            for lane in 0..LANES {
                weights[lane] = exp(weights[lane] - shift[lane]);
                span_sum[lane] += weights[lane];
            }
        }
        let sum = &mut state.sum[half..half + LANES];
        for lane in 0..LANES {
            sum[lane] = sum[lane].mul_add(factor[lane], span_sum[lane]);
        }
        if factor.iter().any(|&f| f != 1.0) {
            let block = &mut state.acc[half * dim..(half + LANES) * dim];
            for column in block.chunks_exact_mut(LANES) {
                for lane in 0..LANES {
                    column[lane] *= factor[lane];
                }
            }
        }
    }
}

/// `acc` (`[2, dim, LANES]`) += the pair's weights (`[SPAN, 2, LANES]`) over `key_range` times
/// those keys' rows of V, `STEP` dims at a time (then one at a time for the rest).
#[inline(always)]
fn accumulate_pair(acc: &mut [f32], weights: &[f32], values: Rows<'_>, key_range: (usize, usize)) {
    let dim = values.dim;
    let whole = dim / STEP * STEP;
    for d in (0..whole).step_by(STEP) {
        accumulate_dims::<STEP>(acc, weights, values, key_range, d);
    }
    for d in whole..dim {
        accumulate_dims::<1>(acc, weights, values, key_range, d);
    }
}

/// `accumulate_pair` for dims `d..d + DIMS`.
#[inline(always)]
fn accumulate_dims<const DIMS: usize>(
    acc: &mut [f32],
    weights: &[f32],
    values: Rows<'_>,
    (first, end): (usize, usize),
    d: usize,
) {
    let dim = values.dim;
    let (low_at, high_at) = (d * LANES, (dim + d) * LANES);
    let mut low = [[0.0f32; LANES]; DIMS];
    let mut high = [[0.0f32; LANES]; DIMS];
    for j in 0..DIMS {
        low[j].copy_from_slice(&acc[low_at + j * LANES..][..LANES]);
        high[j].copy_from_slice(&acc[high_at + j * LANES..][..LANES]);
    }
    let weights = lane_arrays::<PAIR>(&weights[first * PAIR..end * PAIR]);
    for (row, &at) in weights.zip(&values.offsets[first..end]) {
        let value: &[f32; DIMS] = values.data[at + d..at + d + DIMS].try_into().unwrap();
        for j in 0..DIMS {
            for lane in 0..LANES {
                low[j][lane] = value[j].mul_add(row[lane], low[j][lane]);
                high[j][lane] = value[j].mul_add(row[LANES + lane], high[j][lane]);
            }
        }
    }
    for j in 0..DIMS {
        acc[low_at + j * LANES..][..LANES].copy_from_slice(&low[j]);
        acc[high_at + j * LANES..][..LANES].copy_from_slice(&high[j]);
    }
}

/// `accumulate_pair` for one lane block (`acc`, `[dim, LANES]`), weighted by the lanes
/// `HALF..HALF + LANES` of each weight row.
#[inline(always)]
fn accumulate_block<const HALF: usize>(
    acc: &mut [f32],
    weights: &[f32],
    values: Rows<'_>,
    key_range: (usize, usize),
) {
    let dim = values.dim;
    let whole = dim / STEP * STEP;
    for d in (0..whole).step_by(STEP) {
        accumulate_block_dims::<STEP, HALF>(acc, weights, values, key_range, d);
    }
    for d in whole..dim {
        accumulate_block_dims::<1, HALF>(acc, weights, values, key_range, d);
    }
}

/// `accumulate_block` for dims `d..d + DIMS`.
#[inline(always)]
fn accumulate_block_dims<const DIMS: usize, const HALF: usize>(
    acc: &mut [f32],
    weights: &[f32],
    values: Rows<'_>,
    (first, end): (usize, usize),
    d: usize,
) {
    let at = d * LANES;
    let mut sums = [[0.0f32; LANES]; DIMS];
    for (j, sum) in sums.iter_mut().enumerate() {
        sum.copy_from_slice(&acc[at + j * LANES..][..LANES]);
    }
    let weights = lane_arrays::<PAIR>(&weights[first * PAIR..end * PAIR]);
    for (row, &offset) in weights.zip(&values.offsets[first..end]) {
        let value: &[f32; DIMS] = values.data[offset + d..offset + d + DIMS]
            .try_into()
            .unwrap();
        for j in 0..DIMS {
            for lane in 0..LANES {
                sums[j][lane] = value[j].mul_add(row[HALF + lane], sums[j][lane]);
            }
        }
    }
    for (j, sum) in sums.iter().enumerate() {
        acc[at + j * LANES..][..LANES].copy_from_slice(sum);
    }
}

/// `values` as arrays of `N` (the length being a multiple of `N`): indexing one needs no
/// bounds check in the loops above.
#[inline(always)]
fn lane_arrays<const N: usize>(values: &[f32]) -> impl Iterator<Item = &[f32; N]> {
    values
        .chunks_exact(N)
        .map(|chunk| chunk.try_into().unwrap())
}
