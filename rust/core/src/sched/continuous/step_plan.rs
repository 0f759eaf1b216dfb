//! The decisions of one step and the inputs a paged-attention runner feeds its kernels.

use super::BlockLoad;
use crate::kv_cache::BlockMove;

/// kernels (named as vLLM's model runner names them). Batch rows are the scheduled sequences,
/// prefills first; token arrays are flat over the rows' tokens, row by row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub prefill_seq_ids: Vec<u64>,
    pub prefill_tokens: Vec<i32>,
    pub decode_seq_ids: Vec<u64>,
    /// Sequences whose step ends with a sampled token (decodes and finished prefills).
    pub sample_seq_ids: Vec<u64>,
    pub preempted_seq_ids: Vec<u64>,
    /// Requests that ended (finished or aborted) since the previous plan.
    pub finished_seq_ids: Vec<u64>,
    /// Block moves, in the order they must be executed (before the model runs).
    pub moves: Vec<BlockMove>,
    /// Blocks to load from lower tiers for the requests this step admitted to the loading
    /// state (see `ContinuousScheduler::finish_loads`), request by request.
    pub loads: Vec<BlockLoad>,
    /// Per batch row: tokens computed this step, and K/V length after it (`seq_lens`).
    pub query_lens: Vec<i32>,
    pub context_lens: Vec<i32>,
    /// `[rows + 1]`: where each row's tokens start in the flat token arrays.
    pub query_start_loc: Vec<i32>,
    /// Columns the rows' block tables need (the most blocks of any row); the table itself
    /// is written in place by [`ContinuousScheduler::write_block_tables`].
    pub block_table_width: usize,
    /// Per token: its id (prompt ids, then the last sampled token; -1 when the request was
    /// given as a token count), its position in its sequence, and its K/V slot (in every
    /// KV-cache group, group by group: `[num_groups, tokens]`).
    pub input_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i32>,
    /// Per sampling row (in `sample_seq_ids` order): the flat index of its last token.
    pub logits_indices: Vec<i32>,
    pub num_batched_tokens: usize,
    /// KV-cache groups the slots and block tables are given for.
    pub num_groups: usize,
}

impl StepPlan {
    /// The block-table buffer `[groups, rows, columns]` this plan's tables need, given the
    /// shape of the one the caller holds: None if that one fits them, else a new shape,
    /// grown to powers of two (at least 16 rows and columns, never below `held`), so a server
    /// replaces its buffer a handful of times in its life.
    pub fn block_table_shape(&self, held: Option<[usize; 3]>) -> Option<[usize; 3]> {
        let (groups, rows, width) = (
            self.num_groups.max(1),
            self.query_lens.len(),
            self.block_table_width,
        );
        let [held_groups, held_rows, held_columns] = held.unwrap_or_default();
        if held.is_some() && held_groups == groups && rows <= held_rows && width <= held_columns {
            return None;
        }
        let grow = |needed: usize, held: usize| needed.max(held).max(16).next_power_of_two();
        Some([groups, grow(rows, held_rows), grow(width, held_columns)])
    }

    /// Empties every field, keeping the buffers' capacity.
    pub fn clear(&mut self) {
        let StepPlan {
            prefill_seq_ids,
            prefill_tokens,
            decode_seq_ids,
            sample_seq_ids,
            preempted_seq_ids,
            finished_seq_ids,
            moves,
            loads,
            query_lens,
            context_lens,
            query_start_loc,
            block_table_width,
            input_ids,
            positions,
            slot_mapping,
            logits_indices,
            num_batched_tokens,
            num_groups,
        } = self;
        for ids in [
            prefill_seq_ids,
            decode_seq_ids,
            sample_seq_ids,
            preempted_seq_ids,
            finished_seq_ids,
        ] {
            ids.clear();
        }
        for cells in [
            prefill_tokens,
            query_lens,
            context_lens,
            query_start_loc,
            input_ids,
            positions,
            slot_mapping,
            logits_indices,
        ] {
            cells.clear();
        }
        moves.clear();
        loads.clear();
        *block_table_width = 0;
        *num_batched_tokens = 0;
        *num_groups = 0;
    }
}
