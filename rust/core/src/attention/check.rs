//! What a call is checked for, once, before any element is read: shapes that agree, rows
//! that describe the step's tokens, and block tables whose every entry a row reads is a
//! block of the cache (the null block, which a window left behind, is read by no query).

use super::element::Element;
use super::{PagedAttention, Visibility};
use crate::error::CoreResult;

impl<E: Element, C: Element> PagedAttention<'_, E, C> {
    pub(super) fn check(&self, out_len: usize) -> CoreResult<()> {
        let shape = &self.shape;
        ensure!(
            shape.num_heads > 0 && shape.num_kv_heads > 0 && shape.head_dim > 0,
            "heads, KV heads and head_dim must be positive: {shape:?}"
        );
        ensure!(
            shape.num_heads.is_multiple_of(shape.num_kv_heads),
            "{} query heads cannot share {} KV heads evenly",
            shape.num_heads,
            shape.num_kv_heads
        );
        ensure!(shape.block_size > 0, "block_size must be positive");
        match self.visibility {
            Visibility::Sliding { window: 0 } | Visibility::Chunked { chunk: 0 } => {
                return Err(invalid!("a window or chunk of 0 positions attends nothing"));
            }
            _ => {}
        }
        let per_token = shape.num_heads * shape.head_dim;
        ensure!(
            self.query.len().is_multiple_of(per_token) && out_len == self.query.len(),
            "the query ({}) and output ({out_len}) must both be [tokens, {}, {}]",
            self.query.len(),
            shape.num_heads,
            shape.head_dim
        );
        let row = C::row_len(shape.head_dim);
        let slot = shape.num_kv_heads * row;
        let cache = self.key_cache.len();
        ensure!(
            cache == self.value_cache.len() && cache.is_multiple_of(slot * shape.block_size),
            "the key ({cache}) and value ({}) caches must both be [blocks × {}, {}, {row}]",
            self.value_cache.len(),
            shape.block_size,
            shape.num_kv_heads,
        );
        if let Some(sinks) = self.sinks {
            ensure!(
                sinks.len() == shape.num_heads,
                "sinks has {} entries for {} heads",
                sinks.len(),
                shape.num_heads
            );
        }
        self.check_rows(
            self.query.len() / per_token,
            cache / (slot * shape.block_size),
        )
    }

    fn check_rows(&self, tokens: usize, num_blocks: usize) -> CoreResult<()> {
        let rows = &self.rows;
        let count = rows.seq_lens.len();
        ensure!(
            rows.query_start_loc.len() == count + 1,
            "query_start_loc has {} entries for {count} rows (needs rows + 1)",
            rows.query_start_loc.len()
        );
        ensure!(
            rows.block_tables.len() == count * rows.width,
            "block_tables has {} entries, not {count} rows of {}",
            rows.block_tables.len(),
            rows.width
        );
        ensure!(
            rows.query_start_loc[0] == 0 && rows.query_start_loc[count] as usize == tokens,
            "query_start_loc must run from 0 to the {tokens} tokens of the query"
        );
        for row in 0..count {
            let (start, end) = (rows.query_start_loc[row], rows.query_start_loc[row + 1]);
            let seq_len = rows.seq_lens[row];
            ensure!(
                start <= end && seq_len >= end - start,
                "row {row}: {} new tokens (query_start_loc {start}..{end}) in a sequence of \
                 {seq_len}",
                end - start
            );
            if start < end {
                self.check_table(row, (seq_len - (end - start)) as usize, num_blocks)?;
            }
        }
        Ok(())
    }

    /// That every block row `row` reads — from its first query's first visible position on
    /// — is within its table and a block of the cache.
    fn check_table(&self, row: usize, first_position: usize, num_blocks: usize) -> CoreResult<()> {
        let rows = &self.rows;
        let block_size = self.shape.block_size;
        let last = rows.seq_lens[row] as usize - 1;
        let first = self.visibility.first_visible(first_position) / block_size;
        ensure!(
            last / block_size < rows.width,
            "row {row}: {} tokens need {} blocks; its table has {}",
            last + 1,
            last / block_size + 1,
            rows.width
        );
        let table = &rows.block_tables[row * rows.width..(row + 1) * rows.width];
        for (index, &block) in table
            .iter()
            .enumerate()
            .take(last / block_size + 1)
            .skip(first)
        {
            ensure!(
                block > 0 && (block as usize) < num_blocks,
                "row {row}: block_tables[{index}] = {block} is not a block of the cache \
                 (1..{num_blocks}; 0 is the null block)"
            );
        }
        Ok(())
    }
}
