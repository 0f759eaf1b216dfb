//! Attending one work item (`item`): the query heads that share one KV head, for a tile of
//! one row's new tokens, over the row's K/V span by span (`SPAN` positions, read through
//! the block table whatever the block size) with an online softmax (no score matrix, no
//! gathered copy of the context).
//!
//! A decode row takes `decode`'s path, an item of many query vectors (a prefill tile)
//! `lane_tile`'s. For one of few (a prefill's last tile), per span, the item's K is
//! converted to `f32` transposed (`[head_dim, SPAN]`), so that the scores of half a quad's
//! query vectors over two `KEYS`-wide columns of keys are a register tile that `head_dim`
//! steps of two loads and four broadcast multiply-add pairs fill (`score_quad`), and V kept
//! as rows, so that the weighted sum is such a tile too (vectors × two `KEYS`-wide columns
//! of dims): no horizontal sum anywhere in the loop. A quad scores and sums only the keys
//! its last vector sees, so a causal tile skips what lies past each of its quads' diagonal.

use super::decode::{self, DECODE_SPAN};
use super::element::Element;
use super::item::{
    load_queries, load_span, online_softmax, write_out, Output, Place, Scratch, WorkItem, QUAD,
    SPAN, TOKEN_TILE,
};
use super::lane_tile::{self, LANES, PAIR};
use super::lanes::{add_scaled, dot, KeyScores};
use super::{AttentionShape, PagedAttention};

/// Keys (or dims, in the weighted sum) per column of a register tile: one AVX-512 register
/// of `f32`.
const KEYS: usize = 16;

// Sized here, where every path is chosen: the tiles each one pads to are known.
impl Scratch {
    pub(super) fn new(shape: &AttentionShape) -> Self {
        let (heads, head_dim) = (shape.num_heads, shape.head_dim);
        let group = heads / shape.num_kv_heads;
        // A tile of tokens, or a decode's every head (`decode`); both paths pad to whole
        // register tiles: a quad, or a pair of lane blocks.
        let vectors = (group * TOKEN_TILE)
            .max(heads)
            .next_multiple_of(PAIR.max(QUAD));
        Scratch {
            sizes: (group, head_dim, heads),
            queries: vec![0.0; vectors * head_dim],
            acc: vec![0.0; vectors * head_dim],
            max: vec![0.0; vectors],
            sum: vec![0.0; vectors],
            keys_t: vec![0.0; head_dim * SPAN],
            values: vec![0.0; SPAN * head_dim],
            row: vec![0.0; head_dim],
            scores: vec![0.0; (SPAN * PAIR.max(QUAD)).max(heads * DECODE_SPAN)],
            lane_sums: vec![[[0.0; LANES]; LANES]; heads],
            seen: vec![(0, 0); vectors],
            offsets: vec![0; SPAN],
        }
    }
}

/// Attends `item`, writing its tokens' heads of `out` (`[tokens, heads, head_dim]`).
///
/// # Safety
/// `out` points at the call's output, of `tokens × heads × head_dim` elements, and no other
/// thread writes this item's part of it.
#[inline(always)]
pub(super) unsafe fn attend<E: Element, C: Element, S: KeyScores>(
    call: &PagedAttention<'_, E, C>,
    item: WorkItem,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    let dim = call.shape.head_dim;
    let row = item.row as usize;
    if call.rows.query_len(row) == 1 {
        let heads = (item.kv_head as usize, item.kv_heads as usize);
        return decode::attend::<E, C, S>(call, row, heads, scratch, out);
    }
    let place = Place::of(call, item);
    let vectors = place.vectors;
    let rows = &call.rows;
    let table = &rows.block_tables[row * rows.width..(row + 1) * rows.width];
    if vectors >= LANES {
        return lane_tile::attend::<E, C, S>(call, &place, table, scratch, out);
    }
    load_queries(call, &place, scratch);
    let (lowest, highest) = place.keys(call.visibility);
    // One or two vectors (a prefill's last tile with one or two query heads per KV head)
    // fill too little of a tile to pay for transposing K: they take a dot product per key.
    let by_rows = vectors <= 2;
    for first_key in (lowest..=highest).step_by(SPAN) {
        let end_key = (first_key + SPAN).min(highest + 1);
        load_span(
            call,
            scratch,
            table,
            (first_key, end_key, highest + 1),
            place.kv_head,
            by_rows,
        );
        if by_rows {
            score_rows(call, scratch, end_key - first_key, vectors);
        }
        for quad in (0..vectors).step_by(QUAD) {
            // The quad's last vector sees furthest: no key past it is scored or summed.
            let last = place.vector((quad + QUAD).min(vectors) - 1).0;
            let seen_end = (place.position(last) + 1).min(end_key);
            if seen_end <= first_key {
                continue;
            }
            let keys = seen_end - first_key;
            if !by_rows {
                let queries = &scratch.queries[quad * dim..(quad + QUAD) * dim];
                score_quad(queries, &scratch.keys_t, dim, keys, &mut scratch.scores);
            }
            softmax_quad(call, &place, scratch, quad, (first_key, seen_end));
            let acc = &mut scratch.acc[quad * dim..(quad + QUAD) * dim];
            let (weights, values) = (&scratch.scores, &scratch.values);
            if by_rows {
                accumulate::<1, 2>(acc, weights, values, dim, keys);
            } else {
                accumulate::<2, { QUAD / 2 }>(acc, weights, values, dim, keys);
            }
        }
    }
    write_out(call, &place, scratch, out);
}

/// Turns the scores of the quad's vectors over keys `first_key..end_key` into softmax
/// weights (zero where a vector does not see a key), rescaling each one's sums when its
/// maximum grows.
#[inline(always)]
fn softmax_quad<E, C>(
    call: &PagedAttention<'_, E, C>,
    place: &Place,
    scratch: &mut Scratch,
    quad: usize,
    (first_key, end_key): (usize, usize),
) {
    let dim = call.shape.head_dim;
    let keys = end_key - first_key;
    // Padding vectors past the item's last are left alone: their sums are never written.
    for i in quad..(quad + QUAD).min(place.vectors) {
        let position = place.position(place.vector(i).0);
        let from = call.visibility.first_visible(position).max(first_key);
        let to = (position + 1).min(end_key);
        // A query before this span, or whose window starts after it, sees none of it.
        let (skip, end) = ((from - first_key).min(keys), to.saturating_sub(first_key));
        let at = (i - quad) * SPAN;
        let weights = &mut scratch.scores[at..at + keys];
        // Keys this vector does not see weigh nothing in the tile's sums.
        weights[..skip].fill(0.0);
        weights[end.max(skip)..].fill(0.0);
        if skip >= end {
            continue;
        }
        online_softmax(
            &mut weights[skip..end],
            (&mut scratch.max[i], &mut scratch.sum[i]),
            &mut scratch.acc[i * dim..(i + 1) * dim],
        );
    }
}

/// The scores of the `QUAD` vectors of `queries` over the first `keys` keys of `keys_t`
/// (`[head_dim, SPAN]`), into `scores` (`[QUAD, SPAN]`), a `QUAD` × `KEYS` tile at a time
/// (the last tile's keys past `keys` are scored too, and never read).
#[inline(always)]
fn score_quad(queries: &[f32], keys_t: &[f32], dim: usize, keys: usize, scores: &mut [f32]) {
    // Half a quad over two key columns at a time: per `d`, two loads and four broadcasts
    // feed eight multiply-adds (a whole quad over one column would take nine loads).
    const HALF: usize = QUAD / 2;
    for half in [0, HALF] {
        for chunk in (0..keys).step_by(2 * KEYS) {
            let mut low = [[0.0f32; KEYS]; HALF];
            let mut high = [[0.0f32; KEYS]; HALF];
            for d in 0..dim {
                let at = d * SPAN + chunk;
                let (column_low, column_high) =
                    (&keys_t[at..at + KEYS], &keys_t[at + KEYS..at + 2 * KEYS]);
                for i in 0..HALF {
                    let q = queries[(half + i) * dim + d];
                    for k in 0..KEYS {
                        low[i][k] = q.mul_add(column_low[k], low[i][k]);
                        high[i][k] = q.mul_add(column_high[k], high[i][k]);
                    }
                }
            }
            for i in 0..HALF {
                let at = (half + i) * SPAN + chunk;
                scores[at..at + KEYS].copy_from_slice(&low[i]);
                scores[at + KEYS..at + 2 * KEYS].copy_from_slice(&high[i]);
            }
        }
    }
}

/// The scores of the first `vectors` (at most `QUAD`) query vectors over the span's `keys`
/// keys (as rows in `keys_t`, `load_span` with `by_rows`), a dot product per key, into
/// `scores` as `score_quad` leaves them.
#[inline(always)]
fn score_rows<E, C>(
    call: &PagedAttention<'_, E, C>,
    scratch: &mut Scratch,
    keys: usize,
    vectors: usize,
) {
    let dim = call.shape.head_dim;
    for key in 0..keys {
        let row = &scratch.keys_t[key * dim..(key + 1) * dim];
        for i in 0..vectors {
            let query = &scratch.queries[i * dim..(i + 1) * dim];
            scratch.scores[i * SPAN + key] = dot(query, row);
        }
    }
}

/// `acc` (`GROUPS × ROWS` vectors of `head_dim`) += the weights of `weights` (`[vectors,
/// SPAN]`) times the first `keys` rows of `values`: `ROWS` vectors × 32 dims of accumulators
/// at a time (per key, two loads of V and `ROWS` broadcast weights), the dims past the last
/// whole 32 one vector at a time.
#[inline(always)]
fn accumulate<const GROUPS: usize, const ROWS: usize>(
    acc: &mut [f32],
    weights: &[f32],
    values: &[f32],
    dim: usize,
    keys: usize,
) {
    let whole = dim / (2 * KEYS) * (2 * KEYS);
    for group in (0..GROUPS * ROWS).step_by(ROWS) {
        for chunk in (0..whole).step_by(2 * KEYS) {
            let mut low = [[0.0f32; KEYS]; ROWS];
            let mut high = [[0.0f32; KEYS]; ROWS];
            for i in 0..ROWS {
                let at = (group + i) * dim + chunk;
                low[i].copy_from_slice(&acc[at..at + KEYS]);
                high[i].copy_from_slice(&acc[at + KEYS..at + 2 * KEYS]);
            }
            for key in 0..keys {
                let at = key * dim + chunk;
                let (value_low, value_high) =
                    (&values[at..at + KEYS], &values[at + KEYS..at + 2 * KEYS]);
                for i in 0..ROWS {
                    let weight = weights[(group + i) * SPAN + key];
                    for k in 0..KEYS {
                        low[i][k] = weight.mul_add(value_low[k], low[i][k]);
                        high[i][k] = weight.mul_add(value_high[k], high[i][k]);
                    }
                }
            }
            for i in 0..ROWS {
                let at = (group + i) * dim + chunk;
                acc[at..at + KEYS].copy_from_slice(&low[i]);
                acc[at + KEYS..at + 2 * KEYS].copy_from_slice(&high[i]);
            }
        }
    }
    if whole < dim {
        for (i, sums) in acc.chunks_exact_mut(dim).take(GROUPS * ROWS).enumerate() {
            for key in 0..keys {
                let value = &values[key * dim + whole..(key + 1) * dim];
                add_scaled(&mut sums[whole..], weights[i * SPAN + key], value);
            }
        }
    }
}
