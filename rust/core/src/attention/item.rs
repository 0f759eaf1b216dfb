//! One work item of paged attention, and what every path over it shares: where its query
//! vectors sit (`Place`), its per-thread buffers (`Scratch`), where its outputs go
//! (`Output`); loading its queries and a span of its K/V, the online softmax, and writing
//! out the finished vectors. The paths themselves are `kernel`'s (few vectors, and the
//! choice of path), `lane_tile`'s (many) and `decode`'s (a decode row).

use super::element::Element;
use super::lanes::{exp, exp_shifted_sum, max, scale, LANES};
use super::{PagedAttention, Visibility};

/// Tokens of one prefill row attended together: their K/V blocks are read once for all.
pub(super) const TOKEN_TILE: usize = 64;
/// Query vectors whose softmax `kernel` takes together (`softmax_quad`), and the width of
/// one column of its register tiles: half a quad over two columns is eight AVX-512
/// registers, enough multiply-adds in flight to hide their latency. `load_queries` pads an
/// item's vectors to a whole quad.
pub(super) const QUAD: usize = 8;
/// Key positions converted and attended at once (a multiple of `kernel`'s `KEYS`): the softmax
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
    /// Per vector of a decode, its products with sixteen keys, lane by lane (`decode`).
    pub(super) lane_sums: Vec<[[f32; LANES]; LANES]>,
    /// Per vector, the first and last positions it sees (`lane_tile`).
    pub(super) seen: Vec<(u32, u32)>,
    /// Where each key of a span has its K and V rows (`lane_tile`).
    pub(super) offsets: Vec<usize>,
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
    pub(super) fn of<E, C>(call: &PagedAttention<'_, E, C>, item: WorkItem) -> Self {
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
    pub(super) fn heads<E, C>(
        call: &PagedAttention<'_, E, C>,
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

/// Loads the item's queries, pre-scaled, and starts its softmax state.
#[inline(always)]
pub(super) fn load_queries<E: Element, C>(
    call: &PagedAttention<'_, E, C>,
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
/// As `kernel::attend`'s.
#[inline(always)]
pub(super) unsafe fn write_out<E: Element, C>(
    call: &PagedAttention<'_, E, C>,
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

/// Converts the K/V of positions `first_key..end_key` of the row whose block table is
/// `table`, for `kv_head`: keys transposed into `keys_t` (`[head_dim, SPAN]`), or as rows
/// when they are scored `by_rows`; values as rows into `values`. The rows of positions up to
/// `PREFETCH_AHEAD` further, below `prefetch_end`, are prefetched meanwhile.
#[inline(always)]
pub(super) fn load_span<E, C: Element>(
    call: &PagedAttention<'_, E, C>,
    scratch: &mut Scratch,
    table: &[i32],
    (first_key, end_key, prefetch_end): (usize, usize, usize),
    kv_head: usize,
    by_rows: bool,
) {
    let shape = &call.shape;
    let (dim, block_size) = (shape.head_dim, shape.block_size);
    let row = C::row_len(dim);
    let row_at = |position: usize| {
        let slot = table[position / block_size] as usize * block_size + position % block_size;
        (slot * shape.num_kv_heads + kv_head) * row
    };
    for position in first_key..end_key {
        let key = position - first_key;
        if position + PREFETCH_AHEAD < prefetch_end {
            let ahead = row_at(position + PREFETCH_AHEAD);
            prefetch(&call.key_cache[ahead..ahead + row]);
            prefetch(&call.value_cache[ahead..ahead + row]);
        }
        let at = row_at(position);
        if by_rows {
            C::load(
                &call.key_cache[at..at + row],
                &mut scratch.keys_t[key * dim..(key + 1) * dim],
            );
        } else {
            C::load(&call.key_cache[at..at + row], &mut scratch.row[..dim]);
            for (d, &value) in scratch.row[..dim].iter().enumerate() {
                scratch.keys_t[d * SPAN + key] = value;
            }
        }
        C::load(
            &call.value_cache[at..at + row],
            &mut scratch.values[key * dim..(key + 1) * dim],
        );
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
