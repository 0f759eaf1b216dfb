//! One work item of paged attention: the query heads that share one KV head, for a tile of
//! one row's new tokens, attending over the row's K/V span by span (`SPAN` positions, read
//! through the block table whatever the block size) with an online softmax (no score matrix,
//! no gathered copy of the context).
//!
//! A decode row takes `decode`'s path, an item of many query vectors (a prefill tile)
//! `lane_tile`'s. For one of few (a prefill's last tile), per span, the item's K is
//! converted to `f32` transposed (`[head_dim, SPAN]`), so that the scores of half a quad's
//! query vectors over two `KEYS`-wide columns of keys are a register tile that `head_dim` steps of two loads and four broadcast multiply-add pairs
//! fill (`score_quad`), and V kept as rows, so that the weighted sum is such a tile too
//! (vectors × two `KEYS`-wide columns of dims): no horizontal sum anywhere in the loop. A quad
//! scores and sums only the keys its last vector sees, so a causal tile skips what lies past
//! each of its quads' diagonal.

use super::decode::{self, DECODE_SPAN};
use super::element::Element;
use super::lane_tile::{self, LANES, PAIR};
use super::lanes::{add_scaled, dot, exp, exp_shifted_sum, max, scale};
use super::{AttentionShape, PagedAttention, Visibility};

/// Tokens of one prefill row attended together: their K/V blocks are read once for all.
pub(super) const TOKEN_TILE: usize = 64;
/// Query vectors whose softmax is taken together (`softmax_quad`), and the width of one
/// column of a register tile: half a quad over two columns is eight AVX-512 registers,
/// enough multiply-adds in flight to hide their latency.
const QUAD: usize = 8;
const KEYS: usize = 16;
/// Key positions converted and attended at once (a multiple of `KEYS`): the softmax
/// rescales once per span, not once per block.
pub(super) const SPAN: usize = 64;

/// The item: `row`'s new tokens `tokens` (indices into the step's tokens), with the query
/// heads of KV heads `kv_head..kv_head + kv_heads` (several only for a decode, `decode`;
/// `kv_head` then a multiple of `kv_heads`).
#[derive(Debug, Clone, Copy)]
pub(super) struct WorkItem {
    pub row: u32,
    pub kv_head: u32,
    pub kv_heads: u32,
    pub tokens: (u32, u32),
}

/// Per-thread buffers, sized once for the largest item.
pub(super) struct Scratch {
    /// The (query heads per KV head, head_dim, query heads) it was sized for.
    pub sizes: (usize, usize, usize),
    pub(super) queries: Vec<f32>,
    pub(super) acc: Vec<f32>,
    pub(super) max: Vec<f32>,
    pub(super) sum: Vec<f32>,
    pub(super) keys_t: Vec<f32>,
    pub(super) values: Vec<f32>,
    pub(super) row: Vec<f32>,
    pub(super) scores: Vec<f32>,
    /// Per vector, the first and last positions it sees (`lane_tile`).
    pub(super) seen: Vec<(u32, u32)>,
    /// Where each key of a span has its K and V rows (`lane_tile`).
    pub(super) offsets: Vec<usize>,
}

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
            seen: vec![(0, 0); vectors],
            offsets: vec![0; SPAN],
        }
    }
}

/// Where outputs go: every item writes its own tokens' heads, which no other item writes.
#[derive(Clone, Copy)]
pub(super) struct Output<E>(pub *mut E);

// Items write disjoint parts of the output (see `attend`).
unsafe impl<E: Send> Send for Output<E> {}
unsafe impl<E: Send> Sync for Output<E> {}

/// Where an item's query vectors sit: vector `i` is token `first_token + i / group`, query
/// head `kv_head * group + i % group`; the row's new tokens start at step token `row_start`,
/// position `first_position`.
#[derive(Clone, Copy)]
pub(super) struct Place {
    pub(super) tokens: (usize, usize),
    row_start: usize,
    first_position: usize,
    group: usize,
    pub(super) kv_head: usize,
    pub(super) vectors: usize,
}

impl Place {
    fn of<E>(call: &PagedAttention<'_, E>, item: WorkItem) -> Self {
        let rows = &call.rows;
        let row = item.row as usize;
        let row_start = rows.query_start_loc[row] as usize;
        let query_len = rows.query_start_loc[row + 1] as usize - row_start;
        let group = call.shape.num_heads / call.shape.num_kv_heads;
        let tokens = (item.tokens.0 as usize, item.tokens.1 as usize);
        Place {
            tokens,
            row_start,
            first_position: rows.seq_lens[row] as usize - query_len,
            group,
            kv_head: item.kv_head as usize,
            vectors: (tokens.1 - tokens.0) * group,
        }
    }

    /// The position of step token `token`.
    pub(super) fn position(&self, token: usize) -> usize {
        self.first_position + token - self.row_start
    }

    /// The first and last positions any of the item's tokens sees.
    pub(super) fn keys(&self, visibility: Visibility) -> (usize, usize) {
        (
            visibility.first_visible(self.position(self.tokens.0)),
            self.position(self.tokens.1 - 1),
        )
    }

    /// Decode row `row`'s token with the query heads of KV heads `first_kv_head..` (`kv_heads`
    /// of them, `first_kv_head` a multiple of `kv_heads`), as one group of vectors.
    pub(super) fn heads<E>(
        call: &PagedAttention<'_, E>,
        row: usize,
        first_kv_head: usize,
        kv_heads: usize,
    ) -> Self {
        let row_start = call.rows.query_start_loc[row] as usize;
        let group = call.shape.num_heads / call.shape.num_kv_heads * kv_heads;
        Place {
            tokens: (row_start, row_start + 1),
            row_start,
            first_position: call.rows.seq_lens[row] as usize - 1,
            group,
            kv_head: first_kv_head / kv_heads,
            vectors: group,
        }
    }

    /// The step token and query head of vector `i`.
    pub(super) fn vector(&self, i: usize) -> (usize, usize) {
        (
            self.tokens.0 + i / self.group,
            self.kv_head * self.group + i % self.group,
        )
    }
}

/// Attends `item`, writing its tokens' heads of `out` (`[tokens, heads, head_dim]`).
///
/// # Safety
/// `out` points at the call's output, of `tokens × heads × head_dim` elements, and no other
/// thread writes this item's part of it.
#[inline(always)]
pub(super) unsafe fn attend<E: Element>(
    call: &PagedAttention<'_, E>,
    item: WorkItem,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    let dim = call.shape.head_dim;
    let row = item.row as usize;
    if call.rows.query_len(row) == 1 {
        let heads = (item.kv_head as usize, item.kv_heads as usize);
        return decode::attend(call, row, heads, scratch, out);
    }
    let place = Place::of(call, item);
    let vectors = place.vectors;
    let rows = &call.rows;
    let table = &rows.block_tables[row * rows.width..(row + 1) * rows.width];
    if vectors >= LANES {
        return lane_tile::attend(call, &place, table, scratch, out);
    }
    load_queries(call, &place, scratch);
    let (lowest, highest) = place.keys(call.visibility);
    // One or two vectors (a decode with few query heads per KV head) fill too little of a
    // tile to pay for transposing K: they take a dot product per key instead.
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

/// Loads the item's queries, pre-scaled, and starts its softmax state.
#[inline(always)]
pub(super) fn load_queries<E: Element>(
    call: &PagedAttention<'_, E>,
    place: &Place,
    scratch: &mut Scratch,
) {
    let (dim, vectors) = (call.shape.head_dim, place.vectors);
    for i in 0..vectors {
        let (token, head) = place.vector(i);
        let at = (token * call.shape.num_heads + head) * dim;
        let query = &mut scratch.queries[i * dim..(i + 1) * dim];
        E::load(&call.query[at..at + dim], query);
        scale(query, call.scale);
    }
    // Padding vectors of the last quad: zeros, whose scores nobody reads.
    scratch.queries[vectors * dim..vectors.next_multiple_of(QUAD) * dim].fill(0.0);
    scratch.acc[..vectors.next_multiple_of(QUAD) * dim].fill(0.0);
    scratch.max[..vectors].fill(f32::NEG_INFINITY);
    scratch.sum[..vectors].fill(0.0);
}

/// Turns the scores of the quad's vectors over keys `first_key..end_key` into softmax
/// weights (zero where a vector does not see a key), rescaling each one's sums when its
/// maximum grows.
#[inline(always)]
fn softmax_quad<E>(
    call: &PagedAttention<'_, E>,
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

/// Turns one vector's `scores` over a span into its softmax weights against its running
/// `max` and `sum`, rescaling its weighted sums `acc` when the maximum grows.
#[inline(always)]
pub(super) fn online_softmax(
    scores: &mut [f32],
    (max_so_far, sum): (&mut f32, &mut f32),
    acc: &mut [f32],
) {
    let span_max = max(scores);
    if span_max > *max_so_far {
        let factor = exp(*max_so_far - span_max);
        *sum *= factor;
        scale(acc, factor);
        *max_so_far = span_max;
    }
    *sum += exp_shifted_sum(scores, *max_so_far);
}

/// Ends each vector's softmax (gpt-oss's sink included) and writes it to `out`.
///
/// # Safety
/// As `attend`'s.
#[inline(always)]
pub(super) unsafe fn write_out<E: Element>(
    call: &PagedAttention<'_, E>,
    place: &Place,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    let dim = call.shape.head_dim;
    for i in 0..place.vectors {
        let (token, head) = place.vector(i);
        let (mut max, mut sum) = (scratch.max[i], scratch.sum[i]);
        let acc = &mut scratch.acc[i * dim..(i + 1) * dim];
        if let Some(sinks) = call.sinks {
            // gpt-oss: one more logit per head, whose value is nothing.
            let sink = sinks[head];
            if sink > max {
                let factor = exp(max - sink);
                sum *= factor;
                scale(acc, factor);
                max = sink;
            }
            sum += exp(sink - max);
        }
        scale(acc, 1.0 / sum);
        let at = (token * call.shape.num_heads + head) * dim;
        // Safety: the caller's contract; this item alone writes (token, head).
        let target = std::slice::from_raw_parts_mut(out.0.add(at), dim);
        E::store(acc, target);
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
fn score_rows<E>(call: &PagedAttention<'_, E>, scratch: &mut Scratch, keys: usize, vectors: usize) {
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

/// Converts the K/V of positions `first_key..end_key` of the row whose block table is
/// `table`, for `kv_head`: keys transposed into `keys_t` (`[head_dim, SPAN]`), or as rows
/// when they are scored `by_rows`; values as rows into `values`. The rows of positions up to
/// `PREFETCH_AHEAD` further, below `prefetch_end`, are prefetched meanwhile.
#[inline(always)]
pub(super) fn load_span<E: Element>(
    call: &PagedAttention<'_, E>,
    scratch: &mut Scratch,
    table: &[i32],
    (first_key, end_key, prefetch_end): (usize, usize, usize),
    kv_head: usize,
    by_rows: bool,
) {
    let shape = &call.shape;
    let (dim, block_size) = (shape.head_dim, shape.block_size);
    let row_at = |position: usize| {
        let slot = table[position / block_size] as usize * block_size + position % block_size;
        (slot * shape.num_kv_heads + kv_head) * dim
    };
    for position in first_key..end_key {
        let key = position - first_key;
        if position + PREFETCH_AHEAD < prefetch_end {
            let ahead = row_at(position + PREFETCH_AHEAD);
            prefetch(&call.key_cache[ahead..ahead + dim]);
            prefetch(&call.value_cache[ahead..ahead + dim]);
        }
        let at = row_at(position);
        if by_rows {
            E::load(
                &call.key_cache[at..at + dim],
                &mut scratch.keys_t[key * dim..(key + 1) * dim],
            );
        } else {
            E::load(&call.key_cache[at..at + dim], &mut scratch.row);
            for (d, &value) in scratch.row.iter().enumerate() {
                scratch.keys_t[d * SPAN + key] = value;
            }
        }
        E::load(
            &call.value_cache[at..at + dim],
            &mut scratch.values[key * dim..(key + 1) * dim],
        );
    }
}

impl Visibility {
    /// The first position a query at `position` attends.
    #[inline(always)]
    pub(super) fn first_visible(self, position: usize) -> usize {
        match self {
            Visibility::Causal => 0,
            Visibility::Sliding { window } => (position + 1).saturating_sub(window),
            Visibility::Chunked { chunk } => position / chunk * chunk,
        }
    }
}

/// Keys ahead whose K and V rows `load_span` prefetches. One KV head's row of a token sits
/// `num_kv_heads` rows from the next token's (the cache is `[slots, kv_heads, head_dim]`):
/// with 8 KV heads of 128 in bf16, a 256-byte read every 2 KiB, two to a 4 KiB page, where
/// the hardware's prefetcher stops; a decode read its K/V at a third of the bandwidth a
/// 2-head cache got.
const PREFETCH_AHEAD: usize = 8;

/// Asks the CPU to bring `data`'s cache lines into L1 (a hint: nothing else changes).
#[inline(always)]
pub(super) fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = data.as_ptr().cast::<i8>();
        for line in (0..std::mem::size_of_val(data)).step_by(64) {
            // Safety: the address lies inside `data`; a prefetch reads nothing back.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(line)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}
