//! What kernels read: slot mappings, padded block tables, context lengths, FlashInfer's CSR
//! page table; and the check that a kernel only writes slots some sequence holds.

use super::{GroupTable, KvCache};

/// One group's block list of a sequence as a block table row sees it: the blocks (the null
/// block where released or not yet allocated), how many leading ones a window released, and
/// a stamp that changes whenever a block already in the list is replaced (not when the list
/// grows or its window releases blocks).
#[derive(Debug, Clone, Copy)]
pub struct RowView<'a> {
    pub blocks: &'a [u32],
    pub released: usize,
    pub layout: u64,
}
use crate::alloc::NULL_BLOCK;
use crate::error::CoreResult;

impl GroupTable {
    pub(super) fn row_view(&self) -> RowView<'_> {
        RowView {
            blocks: self.blocks(),
            released: self.released(),
            layout: self.layout(),
        }
    }
}

/// What a row of a persistent block table holds: the first `written` blocks of `seq_id`
/// under `layout`, the first `released` of them null. Lets the row be brought up to date by
/// writing only what changed.
#[derive(Debug, Clone, Copy, Default)]
pub struct RowMemo {
    seq_id: u64,
    layout: u64,
    written: usize,
    released: usize,
}

impl RowMemo {
    /// Brings `row` (which holds what this memo says, or is all null for a default memo) up
    /// to date with `view`, the list of `seq_id`: only new cells and newly released ones
    /// when the memo still describes the list, else the whole row.
    #[inline]
    pub fn update(&mut self, row: &mut [i32], seq_id: u64, view: RowView<'_>) {
        let blocks = view.blocks;
        let memo = *self;
        let from = match memo.seq_id == seq_id && memo.layout == view.layout {
            true if memo.written <= blocks.len() && memo.released <= view.released => {
                row[memo.released..view.released.min(memo.written)].fill(NULL_BLOCK as i32);
                memo.written
            }
            _ => {
                // Clear what a longer list left behind.
                let stale = memo.written.min(row.len());
                if stale > blocks.len() {
                    row[blocks.len()..stale].fill(NULL_BLOCK as i32);
                }
                0
            }
        };
        for (cell, &block) in row[from..].iter_mut().zip(&blocks[from..]) {
            *cell = block as i32;
        }
        *self = RowMemo {
            seq_id,
            layout: view.layout,
            written: blocks.len(),
            released: view.released,
        };
    }

    /// Brings `row` up to date after one token was appended to a list that was up to date
    /// and that nothing else changed: only its last cell can differ (a new block, or the
    /// copy a copy-on-write made of the partly filled last one).
    #[inline]
    pub fn appended(&mut self, row: &mut [i32], view: RowView<'_>) {
        let last = view.blocks.len() - 1;
        row[last] = view.blocks[last] as i32;
        self.written = view.blocks.len();
        self.layout = view.layout;
    }
}

impl KvCache {
    /// Slots of tokens `[starts[i], ends[i])` of each sequence in `group`, concatenated in
    /// batch order.
    pub fn slot_mapping(
        &self,
        group: usize,
        seq_ids: &[u64],
        starts: &[i64],
        ends: &[i64],
        slots: &mut Vec<i32>,
    ) -> CoreResult<()> {
        ensure!(
            starts.len() == seq_ids.len() && ends.len() == seq_ids.len(),
            "seq_ids, starts and ends must have the same length, got {}, {} and {}",
            seq_ids.len(),
            starts.len(),
            ends.len()
        );
        self.check_group(group)?;
        let block_size = self.block_size();
        let mut total = 0usize;
        for ((&seq_id, &start), &end) in seq_ids.iter().zip(starts).zip(ends) {
            let seq = self.device_sequence(seq_id)?;
            let len = seq.num_tokens();
            ensure!(
                start >= 0 && start <= end && end <= len as i64,
                "range [{start}, {end}) of sequence {seq_id} is not within its {len} tokens"
            );
            let table = &seq.tables()[group];
            let (released, allocated) = (
                table.released() * block_size,
                table.allocated() * block_size,
            );
            ensure!(
                start == end || start as usize >= released,
                "range [{start}, {end}) of sequence {seq_id} starts before token {released}: \
                 group {group}'s window released the blocks before it"
            );
            ensure!(
                end as usize <= allocated.max(start as usize),
                "range [{start}, {end}) of sequence {seq_id} ends after token {allocated}: \
                 group {group} takes the blocks after it as they are computed (mark_computed)"
            );
            total += (end - start) as usize;
        }
        slots.clear();
        slots.reserve(total);
        for ((&seq_id, &start), &end) in seq_ids.iter().zip(starts).zip(ends) {
            let blocks = self.sequence(seq_id)?.tables()[group].blocks();
            slots.extend((start as usize..end as usize).map(|position| {
                (blocks[position / block_size] as usize * block_size + position % block_size) as i32
            }));
        }
        Ok(())
    }

    /// The blocks of a device sequence in `group`, its token count and the list's layout
    /// stamp: what a step plan's row needs, in one lookup. `group` must exist.
    pub fn row_view(&self, seq_id: u64, group: usize) -> CoreResult<(&[u32], usize, u64)> {
        let seq = self.device_sequence(seq_id)?;
        let table = &seq.tables()[group];
        Ok((table.blocks(), seq.num_tokens(), table.layout()))
    }

    /// Every group's block list of a device sequence, in group order, in one lookup.
    pub fn group_rows(&self, seq_id: u64) -> CoreResult<impl Iterator<Item = RowView<'_>>> {
        let seq = self.device_sequence(seq_id)?;
        Ok(seq.tables().iter().map(GroupTable::row_view))
    }

    /// Padded block tables of `group`, row-major `[batch, max blocks in the batch]`. Returns
    /// the width.
    pub fn block_tables(
        &self,
        group: usize,
        seq_ids: &[u64],
        out: &mut Vec<i32>,
    ) -> CoreResult<usize> {
        self.check_group(group)?;
        let mut width = 0;
        for &seq_id in seq_ids {
            width = width.max(self.device_sequence(seq_id)?.num_blocks());
        }
        out.clear();
        out.resize(seq_ids.len() * width, NULL_BLOCK as i32);
        if width > 0 {
            for (&seq_id, row) in seq_ids.iter().zip(out.chunks_exact_mut(width)) {
                let blocks = self.sequence(seq_id)?.tables()[group].blocks();
                for (cell, &block) in row.iter_mut().zip(blocks) {
                    *cell = block as i32;
                }
            }
        }
        Ok(width)
    }

    pub fn context_lens(&self, seq_ids: &[u64], out: &mut Vec<i32>) -> CoreResult<()> {
        out.clear();
        out.reserve(seq_ids.len());
        for &seq_id in seq_ids {
            out.push(self.seq_len(seq_id)? as i32);
        }
        Ok(())
    }

    /// FlashInfer's CSR page table of `group`: `indptr[i]..indptr[i+1]` indexes sequence
    /// i's blocks in `indices`; `last_page_len[i]` is how many slots of its last block hold
    /// tokens. A windowed group lists the blocks its window still holds (never the null
    /// block): FlashInfer reads them with `window_left = window - 1`.
    pub fn page_table_csr(
        &self,
        group: usize,
        seq_ids: &[u64],
        indptr: &mut Vec<i32>,
        indices: &mut Vec<i32>,
        last_page_len: &mut Vec<i32>,
    ) -> CoreResult<()> {
        self.check_group(group)?;
        let mut total = 0usize;
        for &seq_id in seq_ids {
            total += self.device_sequence(seq_id)?.num_blocks();
        }
        indptr.clear();
        indices.clear();
        last_page_len.clear();
        indptr.reserve(seq_ids.len() + 1);
        indices.reserve(total);
        last_page_len.reserve(seq_ids.len());
        indptr.push(0);
        let block_size = self.block_size();
        for &seq_id in seq_ids {
            let seq = self.sequence(seq_id)?;
            // The run of blocks the group holds: a window's released blocks before it (read
            // with FlashInfer's `window_left`, the positions shift alike), a lazily admitted
            // prompt's blocks not allocated yet after it.
            let blocks = seq.tables()[group].blocks();
            let first = blocks.iter().position(|&block| block != NULL_BLOCK);
            let first = first.unwrap_or(blocks.len());
            let end = blocks[first..]
                .iter()
                .position(|&block| block == NULL_BLOCK)
                .map_or(blocks.len(), |held| first + held);
            indices.extend(blocks[first..end].iter().map(|&block| block as i32));
            indptr.push(indices.len() as i32);
            let before_last = end.saturating_sub(1) * block_size;
            last_page_len.push(seq.num_tokens().saturating_sub(before_last).min(block_size) as i32);
        }
        Ok(())
    }

    /// Checks that every slot a kernel is about to write lies in a block some sequence holds
    /// (negative slots are padding and skipped).
    pub fn check_slots(&self, slots: &[i32]) -> CoreResult<()> {
        let block_size = self.block_size();
        for &slot in slots.iter().filter(|&&slot| slot >= 0) {
            let block = slot as usize / block_size;
            if block >= self.num_blocks()
                || block == NULL_BLOCK as usize
                || self.tiers.block_pool.ref_count(block as u32) == 0
            {
                return Err(invalid!(
                    "slot {slot} is in block {block}, which no sequence holds: refusing to write there"
                ));
            }
        }
        Ok(())
    }
}
