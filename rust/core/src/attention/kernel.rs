//! One work item of paged attention: the query heads that share one KV head, for a tile of
//! one row's new tokens, attending over the row's K/V block by block with an online softmax
//! (no score matrix, no gathered copy of the context).
//!
//! Per block, the item's K is converted to `f32` transposed (`[head_dim, keys]`), so that
//! the scores of `QUAD` query vectors over `KEYS` keys are a register tile that `head_dim`
//! steps of one load and `QUAD` broadcast multiply-adds fill (`score_quad`), and V kept as
//! rows, so that the weighted sum is multiply-adds over `head_dim` lanes: no horizontal sum
//! anywhere in the loop.

use super::element::Element;
use super::lanes::{add_scaled, dot, exp, exp_shifted_sum, scale};
use super::{PagedAttention, Visibility};

/// Tokens of one prefill row attended together: their K/V blocks are read once for all.
pub(super) const TOKEN_TILE: usize = 64;
/// Query vectors, and keys, whose scores one register tile holds.
const QUAD: usize = 4;
const KEYS: usize = 16;

/// The item: `row`'s new tokens `tokens` (indices into the step's tokens), with the query
/// heads of KV head `kv_head`.
#[derive(Debug, Clone, Copy)]
pub(super) struct WorkItem {
    pub row: u32,
    pub kv_head: u32,
    pub tokens: (u32, u32),
}

/// Per-thread buffers, sized once for the largest item.
pub(super) struct Scratch {
    /// The (query heads per KV head, head_dim, block_size) it was sized for.
    pub sizes: (usize, usize, usize),
    queries: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    keys_t: Vec<f32>,
    values: Vec<f32>,
    row: Vec<f32>,
    scores: Vec<f32>,
}

impl Scratch {
    pub(super) fn new(group: usize, head_dim: usize, block_size: usize) -> Self {
        let vectors = group * TOKEN_TILE;
        let padded = padded_keys(block_size);
        Scratch {
            sizes: (group, head_dim, block_size),
            queries: vec![0.0; vectors.next_multiple_of(QUAD) * head_dim],
            acc: vec![0.0; vectors.next_multiple_of(QUAD) * head_dim],
            max: vec![0.0; vectors],
            sum: vec![0.0; vectors],
            keys_t: vec![0.0; head_dim * padded],
            values: vec![0.0; block_size * head_dim],
            row: vec![0.0; head_dim],
            scores: vec![0.0; QUAD * padded],
        }
    }
}

/// A block's keys rounded up to whole tiles: the row length of `keys_t` and `scores`.
fn padded_keys(block_size: usize) -> usize {
    block_size.next_multiple_of(KEYS)
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
struct Place {
    tokens: (usize, usize),
    row_start: usize,
    first_position: usize,
    group: usize,
    kv_head: usize,
    vectors: usize,
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
    fn position(&self, token: usize) -> usize {
        self.first_position + token - self.row_start
    }

    /// The step token and query head of vector `i`.
    fn vector(&self, i: usize) -> (usize, usize) {
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
    let (dim, block_size) = (call.shape.head_dim, call.shape.block_size);
    let place = Place::of(call, item);
    let vectors = place.vectors;
    load_queries(call, &place, scratch);
    let (lowest, highest) = (
        call.visibility
            .first_visible(place.position(place.tokens.0)),
        place.position(place.tokens.1 - 1),
    );
    let rows = &call.rows;
    let row = item.row as usize;
    let table = &rows.block_tables[row * rows.width..(row + 1) * rows.width];
    let blocks = table.iter().enumerate().take(highest / block_size + 1);
    for (index, &block) in blocks.skip(lowest / block_size) {
        let first_key = (index * block_size).max(lowest);
        let end_key = ((index + 1) * block_size).min(highest + 1);
        let (keys, block) = (end_key - first_key, block as usize);
        // One or two vectors (a decode with few query heads per KV head) fill too little of
        // a tile to pay for transposing K: they take a dot product per key instead.
        let by_rows = vectors <= 2;
        let keys_at = (block, first_key % block_size, keys);
        load_block(call, scratch, keys_at, place.kv_head, by_rows);
        let padded = padded_keys(block_size);
        if by_rows {
            score_rows(call, scratch, keys_at, place.kv_head, vectors);
        }
        for quad in (0..vectors).step_by(QUAD) {
            if !by_rows {
                let queries = &scratch.queries[quad * dim..(quad + QUAD) * dim];
                let shape = (dim, padded);
                score_quad(queries, &scratch.keys_t, shape, keys, &mut scratch.scores);
            }
            softmax_quad(call, &place, scratch, quad, (first_key, end_key));
            let acc = &mut scratch.acc[quad * dim..(quad + QUAD) * dim];
            accumulate_quad(acc, &scratch.scores, &scratch.values, (dim, padded), keys);
        }
    }
    write_out(call, &place, scratch, out);
}

/// Loads the item's queries, pre-scaled, and starts its softmax state.
#[inline(always)]
fn load_queries<E: Element>(call: &PagedAttention<'_, E>, place: &Place, scratch: &mut Scratch) {
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
    let (keys, padded) = (end_key - first_key, padded_keys(call.shape.block_size));
    for i in quad..quad + QUAD {
        let (mut skip, mut end) = (0, 0);
        if i < place.vectors {
            let position = place.position(place.vector(i).0);
            let from = call.visibility.first_visible(position).max(first_key);
            let to = (position + 1).min(end_key);
            // A query before this block, or whose window starts after it, sees none of it.
            (skip, end) = ((from - first_key).min(keys), to.saturating_sub(first_key));
        }
        let at = (i - quad) * padded;
        let weights = &mut scratch.scores[at..at + keys];
        // Keys this vector does not see weigh nothing in the tile's sums.
        weights[..skip].fill(0.0);
        weights[end.max(skip)..].fill(0.0);
        if skip >= end {
            continue;
        }
        let scores = &mut weights[skip..end];
        let block_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let old_max = scratch.max[i];
        if block_max > old_max {
            let factor = exp(old_max - block_max);
            scratch.sum[i] *= factor;
            scale(&mut scratch.acc[i * dim..(i + 1) * dim], factor);
            scratch.max[i] = block_max;
        }
        scratch.sum[i] += exp_shifted_sum(scores, scratch.max[i]);
    }
}

/// Ends each vector's softmax (gpt-oss's sink included) and writes it to `out`.
///
/// # Safety
/// As `attend`'s.
#[inline(always)]
unsafe fn write_out<E: Element>(
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
/// (`[head_dim, padded]`), into `scores` (`[QUAD, padded]`), a `QUAD` × `KEYS` tile at a time.
#[inline(always)]
fn score_quad(
    queries: &[f32],
    keys_t: &[f32],
    (dim, padded): (usize, usize),
    keys: usize,
    scores: &mut [f32],
) {
    for chunk in (0..keys).step_by(KEYS) {
        let mut tile = [[0.0f32; KEYS]; QUAD];
        for d in 0..dim {
            let column = &keys_t[d * padded + chunk..d * padded + chunk + KEYS];
            for (i, row) in tile.iter_mut().enumerate() {
                let q = queries[i * dim + d];
                for (score, &key) in row.iter_mut().zip(column) {
                    *score = q.mul_add(key, *score);
                }
            }
        }
        for (i, row) in tile.iter().enumerate() {
            scores[i * padded + chunk..i * padded + chunk + KEYS].copy_from_slice(row);
        }
    }
}

/// The scores of the first `vectors` (at most `QUAD`) query vectors over keys
/// `first..first + count` of `block`, a dot product per key, into `scores` as `score_quad`
/// leaves them.
#[inline(always)]
fn score_rows<E: Element>(
    call: &PagedAttention<'_, E>,
    scratch: &mut Scratch,
    (block, first, count): (usize, usize, usize),
    kv_head: usize,
    vectors: usize,
) {
    let shape = &call.shape;
    let (dim, block_size) = (shape.head_dim, shape.block_size);
    let padded = padded_keys(block_size);
    for offset in first..first + count {
        let at = ((block * block_size + offset) * shape.num_kv_heads + kv_head) * dim;
        E::load(&call.key_cache[at..at + dim], &mut scratch.row);
        for i in 0..vectors {
            let query = &scratch.queries[i * dim..(i + 1) * dim];
            scratch.scores[i * padded + offset - first] = dot(query, &scratch.row);
        }
    }
}

/// `acc` (`QUAD` vectors of `head_dim`) += the weights of `weights` (`[QUAD, padded]`) times
/// the first `keys` rows of `values`, `QUAD` × `KEYS` accumulators at a time.
#[inline(always)]
fn accumulate_quad(
    acc: &mut [f32],
    weights: &[f32],
    values: &[f32],
    (dim, padded): (usize, usize),
    keys: usize,
) {
    let whole = dim / KEYS * KEYS;
    for chunk in (0..whole).step_by(KEYS) {
        let mut tile = [[0.0f32; KEYS]; QUAD];
        for (i, row) in tile.iter_mut().enumerate() {
            row.copy_from_slice(&acc[i * dim + chunk..i * dim + chunk + KEYS]);
        }
        for key in 0..keys {
            let value = &values[key * dim + chunk..key * dim + chunk + KEYS];
            for (i, row) in tile.iter_mut().enumerate() {
                let weight = weights[i * padded + key];
                for (sum, &v) in row.iter_mut().zip(value) {
                    *sum = weight.mul_add(v, *sum);
                }
            }
        }
        for (i, row) in tile.iter().enumerate() {
            acc[i * dim + chunk..i * dim + chunk + KEYS].copy_from_slice(row);
        }
    }
    if whole < dim {
        for (i, sums) in acc.chunks_exact_mut(dim).enumerate() {
            for key in 0..keys {
                let value = &values[key * dim + whole..(key + 1) * dim];
                add_scaled(&mut sums[whole..], weights[i * padded + key], value);
            }
        }
    }
}

/// Converts keys `first..first + count` of `block` (offsets within it) for `kv_head`:
/// transposed into `keys_t` (`[head_dim, padded]`, from column 0) unless they are scored
/// `by_rows`, and as rows into `values`.
#[inline(always)]
fn load_block<E: Element>(
    call: &PagedAttention<'_, E>,
    scratch: &mut Scratch,
    (block, first, count): (usize, usize, usize),
    kv_head: usize,
    by_rows: bool,
) {
    let shape = &call.shape;
    let (dim, block_size) = (shape.head_dim, shape.block_size);
    let padded = padded_keys(block_size);
    for offset in first..first + count {
        let slot = block * block_size + offset;
        let at = (slot * shape.num_kv_heads + kv_head) * dim;
        if !by_rows {
            E::load(&call.key_cache[at..at + dim], &mut scratch.row);
            for (d, &value) in scratch.row.iter().enumerate() {
                scratch.keys_t[d * padded + offset - first] = value;
            }
        }
        let value_row = &mut scratch.values[(offset - first) * dim..(offset - first + 1) * dim];
        E::load(&call.value_cache[at..at + dim], value_row);
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
