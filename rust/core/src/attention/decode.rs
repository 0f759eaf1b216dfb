//! A decode row (one new token) attended over several KV heads at once, key by key.
//!
//! The cache is `[slots, kv_heads, head_dim]`: one KV head's row of a token sits
//! `num_kv_heads` rows from the next token's, so a piece that reads one head reads a few
//! hundred bytes out of every few KiB, and the hardware's prefetcher, which follows a stream
//! within a page, barely helps. A decode does little arithmetic per byte it reads; it runs
//! at the speed memory delivers. Reading every head of the piece per token walks each
//! token's heads as one contiguous run, block after block: a stream the prefetcher follows.
//!
//! Per span of `DECODE_SPAN` keys: every head's scores (K converted to `f32` one row at a
//! time; per query vector and key, the products left in a register's lanes, and sixteen
//! keys' lanes added up at once, `KeyScores`), the online softmax per vector, then V the same
//! way, each weighted row added into its vectors' sums.

use super::element::Element;
use super::item::{load_queries, online_softmax, prefetch, write_out, Output, Place, Scratch};
use super::lanes::{add_scaled, KeyScores, LANES};
use super::PagedAttention;

/// Keys whose scores are taken before their values are summed: the softmax rescales once
/// per span.
pub(super) const DECODE_SPAN: usize = 32;

/// Attends decode row `row`'s token with the query heads of KV heads `first_kv_head..` (`kv_heads`
/// of them, `first_kv_head` a multiple of `kv_heads`), writing those heads of `out`.
///
/// # Safety
/// As `kernel::attend`'s: `out` is the call's output and no other thread writes these heads
/// of this token.
#[inline(always)]
pub(super) unsafe fn attend<E: Element, C: Element, S: KeyScores>(
    call: &PagedAttention<'_, E, C>,
    row: usize,
    (first_kv_head, kv_heads): (usize, usize),
    scratch: &mut Scratch,
    out: Output<E>,
) {
    let shape = &call.shape;
    let dim = shape.head_dim;
    let group = shape.num_heads / shape.num_kv_heads;
    let place = Place::heads(call, row, first_kv_head, kv_heads);
    load_queries(call, &place, scratch);
    let (lowest, highest) = place.keys(call.visibility);
    let rows = &call.rows;
    let table = &rows.block_tables[row * rows.width..(row + 1) * rows.width];
    // Where position `p`'s rows of the piece's heads start (all of them, contiguous).
    let row = C::row_len(dim);
    let heads_at = |position: usize| {
        let slot = table[position / shape.block_size] as usize * shape.block_size
            + position % shape.block_size;
        (slot * shape.num_kv_heads + first_kv_head) * row
    };
    let width = kv_heads * row;
    for first_key in (lowest..=highest).step_by(DECODE_SPAN) {
        let end_key = (first_key + DECODE_SPAN).min(highest + 1);
        let keys = end_key - first_key;
        for first_of_block in (first_key..end_key).step_by(LANES) {
            let end_of_block = (first_of_block + LANES).min(end_key);
            for position in first_of_block..end_of_block {
                let at = heads_at(position);
                prefetch_ahead(call.key_cache, position, highest + 1, width, &heads_at);
                for head in 0..kv_heads {
                    let key = as_f32(&call.key_cache[at + head * row..][..row], &mut scratch.row);
                    for vector in head * group..(head + 1) * group {
                        let query = &scratch.queries[vector * dim..(vector + 1) * dim];
                        // Safety: the copy of the kernel that names `S` runs where the CPU
                        // has its instructions (`dispatch`).
                        scratch.lane_sums[vector][position - first_of_block] =
                            unsafe { S::lane_products(query, key) };
                    }
                }
            }
            // Rows past the block's end hold stale sums: each sum reads its own row only.
            let (from, count) = (first_of_block - first_key, end_of_block - first_of_block);
            for vector in 0..place.vectors {
                // Safety: as above.
                let sums = unsafe { S::row_sums(&scratch.lane_sums[vector]) };
                scratch.scores[vector * DECODE_SPAN + from..][..count]
                    .copy_from_slice(&sums[..count]);
            }
        }
        for vector in 0..place.vectors {
            let at = vector * DECODE_SPAN;
            online_softmax(
                &mut scratch.scores[at..at + keys],
                (&mut scratch.max[vector], &mut scratch.sum[vector]),
                &mut scratch.acc[vector * dim..(vector + 1) * dim],
            );
        }
        for position in first_key..end_key {
            let at = heads_at(position);
            prefetch_ahead(call.value_cache, position, highest + 1, width, &heads_at);
            for head in 0..kv_heads {
                let value = as_f32(
                    &call.value_cache[at + head * row..][..row],
                    &mut scratch.row,
                );
                for vector in head * group..(head + 1) * group {
                    let weight = scratch.scores[vector * DECODE_SPAN + position - first_key];
                    add_scaled(
                        &mut scratch.acc[vector * dim..(vector + 1) * dim],
                        weight,
                        value,
                    );
                }
            }
        }
    }
    write_out(call, &place, scratch, out);
}

/// One cache row `src` as `f32`s: in place when it holds them, else converted into `row`
/// (as many values as `row` holds: `head_dim`).
#[inline(always)]
fn as_f32<'a, C: Element>(src: &'a [C], row: &'a mut [f32]) -> &'a [f32] {
    match C::as_f32(src) {
        Some(values) => values,
        None => {
            C::load(src, row);
            row
        }
    }
}

/// Keys ahead whose rows are asked for while this one is read: the prefetcher follows the
/// slots of a block, not the jump to the next block.
const AHEAD: usize = 4;

#[inline(always)]
fn prefetch_ahead<E>(
    cache: &[E],
    position: usize,
    end: usize,
    width: usize,
    heads_at: &impl Fn(usize) -> usize,
) {
    if position + AHEAD < end {
        let at = heads_at(position + AHEAD);
        prefetch(&cache[at..at + width]);
    }
}
