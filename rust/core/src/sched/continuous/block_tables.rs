//! The dense block table of a step plan, kept in one buffer across steps and updated in
//! place (as [`crate::BatchTable`] does for a decode batch).
//!
//! Rebuilding `[rows, width]` every step costs rows × width writes — at 4,096 running
//! sequences of a few hundred blocks, megabytes a step, most of it unchanged. A row that
//! holds the same sequence as last step, whose earlier blocks were not replaced since, only
//! gets its new cells; anything else is rewritten. The cost is O(rows + changed cells).

use super::{ContinuousScheduler, StepPlan};
use crate::error::CoreResult;
use crate::kv_cache::{KvCache, RowMemo};

/// A memo per row and KV-cache group, `[rows, groups]`: a row's groups are written
/// together, so their memos sit together.
#[derive(Debug, Clone, Default)]
pub struct BlockTableWriter {
    memos: Vec<RowMemo>,
}

impl BlockTableWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets what the buffer holds: the caller replaced it with a zeroed one.
    pub fn reset(&mut self) {
        self.memos.clear();
    }

    /// Writes the block lists of `seq_ids` (device sequences) as rows of `cells`, one equal
    /// part of `cells` per KV-cache group in group order, each row-major with `stride`
    /// columns, padded with the null block (0). `cells` must be the buffer this writer wrote
    /// before (or zeroed, after `reset`), with no one else writing it.
    pub fn write(
        &mut self,
        cache: &KvCache,
        seq_ids: &[u64],
        cells: &mut [i32],
        stride: usize,
    ) -> CoreResult<()> {
        let groups = cache.num_groups();
        let per_group = cells.len() / groups;
        ensure!(
            seq_ids.len().saturating_mul(stride) <= per_group,
            "a block table buffer of {per_group} cells per group cannot hold {} rows of {stride}",
            seq_ids.len()
        );
        if self.memos.len() < seq_ids.len() * groups {
            self.memos
                .resize(seq_ids.len() * groups, RowMemo::default());
        }
        for (index, &seq_id) in seq_ids.iter().enumerate() {
            // Rows written so far stay consistent with their memos if this one fails.
            for (group, view) in cache.group_rows(seq_id)?.enumerate() {
                ensure!(
                    view.blocks.len() <= stride,
                    "sequence {seq_id} has {} blocks; the buffer rows hold {stride}",
                    view.blocks.len()
                );
                let start = group * per_group + index * stride;
                let row = &mut cells[start..start + stride];
                self.memos[index * groups + group].update(row, seq_id, view);
            }
        }
        Ok(())
    }
}

impl ContinuousScheduler {
    /// Writes the block tables of `plan`'s rows into `cells` (row-major, `stride` columns,
    /// padded with the null block), updating in place what the previous call wrote there;
    /// with several groups, `cells` is cut into one equal part per group, in group order.
    /// `fresh`: `cells` is a new, zeroed buffer. Call it once the plan's moves have run.
    pub fn write_block_tables(
        &mut self,
        cache: &KvCache,
        plan: &StepPlan,
        cells: &mut [i32],
        stride: usize,
        fresh: bool,
    ) -> CoreResult<()> {
        if fresh {
            self.block_tables.reset();
        }
        let mut rows = std::mem::take(&mut self.scratch_ids);
        rows.clear();
        rows.extend_from_slice(&plan.prefill_seq_ids);
        rows.extend_from_slice(&plan.decode_seq_ids);
        let result = self.block_tables.write(cache, &rows, cells, stride);
        self.scratch_ids = rows;
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{KvCacheConfig, Tokens};
    use crate::layout::KvLayout;

    fn dense(cache: &KvCache, seq_ids: &[u64], stride: usize) -> Vec<i32> {
        let mut out = vec![0; seq_ids.len() * stride];
        for (row, &id) in seq_ids.iter().enumerate() {
            for (cell, &block) in out[row * stride..]
                .iter_mut()
                .zip(cache.row_view(id, 0).unwrap().0)
            {
                *cell = block as i32;
            }
        }
        out
    }

    #[test]
    fn incremental_rows_match_a_full_rebuild() {
        let mut cache = KvCacheConfig::new(64, 2, KvLayout::default())
            .prefix_caching(false)
            .build()
            .unwrap();
        let mut writer = BlockTableWriter::new();
        let stride = 16;
        let mut cells = vec![0; 4 * stride];
        for id in 1..=3 {
            cache.alloc_sequence(id, Tokens::Count(3), None).unwrap();
        }
        let mut rows = vec![1, 2, 3];
        let mut slots = Vec::new();
        for step in 0..12 {
            cache.append_tokens(&rows, 1, None, &mut slots).unwrap();
            if step == 3 {
                cache.fork(2, 9).unwrap(); // 2's next append copies its last block
            }
            if step == 6 {
                cache.free_sequence(1).unwrap();
                cache.alloc_sequence(1, Tokens::Count(1), None).unwrap(); // shorter, same id
                rows = vec![3, 1, 2, 9]; // and the rows move
            }
            let mut moves = Vec::new();
            cache.take_moves(&mut moves);
            writer.write(&cache, &rows, &mut cells, stride).unwrap();
            assert_eq!(
                &cells[..rows.len() * stride],
                dense(&cache, &rows, stride),
                "step {step}"
            );
        }
    }
}
