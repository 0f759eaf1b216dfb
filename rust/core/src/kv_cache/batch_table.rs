//! Persistent decode-step buffers: block tables, context lengths and slot mapping for the
//! running batch, kept at fixed addresses and updated in place.
//!
//! A model runner (and a captured CUDA graph) reads these buffers every step. Rebuilding a
//! padded table per step writes `rows × max_blocks` entries; appending one token changes at
//! most one block id, one length and one slot per row, and that is all this writes. A row
//! whose sequence was changed by other calls since (noticed through the sequence's version)
//! is rewritten whole, so the buffers never go stale.

use hashbrown::HashMap;

use crate::alloc::fallible::{
    array_bytes, check_bookkeeping, out_of_host_memory, total_bytes, try_filled_vec,
    try_with_capacity,
};
use crate::alloc::NULL_BLOCK;
use crate::error::CoreResult;
use crate::kv_cache::KvCache;

/// Slot mapping entry of a row with no new token: kernels skip negative slots.
pub const PAD_SLOT: i32 = -1;

/// Most block-table entries (`max_seqs × max_blocks_per_seq`, 1 GiB of int32).
const MAX_CELLS: usize = 1 << 28;

/// Bytes of the row index's hash table for `max_seqs` ids (hashbrown: a power of two of
/// buckets at most 7/8 full, each an entry and a control byte); `None` on overflow.
fn row_index_bytes(max_seqs: usize) -> Option<u64> {
    let buckets = (max_seqs.checked_mul(8)? / 7)
        .max(4)
        .checked_next_power_of_two()?;
    array_bytes::<(u64, u32)>(buckets)?.checked_add(array_bytes::<u8>(buckets)?)
}

#[derive(Debug, Clone, Copy)]
struct Row {
    seq_id: u64,
    /// Where the sequence sat in the cache's slab when last seen (a hint, checked on use).
    slab: u32,
    /// The sequence's version when this row was last written.
    version: u64,
}

#[derive(Debug, Clone)]
pub struct BatchTable {
    max_blocks_per_seq: usize,
    rows: Vec<Row>,
    row_of: HashMap<u64, u32>,
    block_tables: Box<[i32]>,
    context_lens: Box<[i32]>,
    slot_mapping: Box<[i32]>,
    /// Per-step scratch: each row's slab in the cache.
    slabs: Vec<u32>,
}

impl BatchTable {
    pub fn new(max_seqs: usize, max_blocks_per_seq: usize) -> CoreResult<Self> {
        ensure!(max_seqs != 0 && max_blocks_per_seq != 0, "max_seqs and max_blocks_per_seq must be at least 1, got {max_seqs} and {max_blocks_per_seq}");
        let cells = max_seqs
            .checked_mul(max_blocks_per_seq)
            .filter(|&cells| cells <= MAX_CELLS)
            .ok_or_else(|| {
                invalid!(
                    "max_seqs × max_blocks_per_seq = {max_seqs} × {max_blocks_per_seq} is too \
                     large: over 2**28 block-table entries"
                )
            })?;
        let bytes = check_bookkeeping(Self::bookkeeping_bytes(max_seqs, cells), || {
            format!("max_seqs = {max_seqs} (with max_blocks_per_seq = {max_blocks_per_seq})")
        })?;
        let what = format!(
            "the batch table of max_seqs = {max_seqs}, max_blocks_per_seq = \
             {max_blocks_per_seq} ({bytes} bytes in all)"
        );
        let mut row_of = HashMap::new();
        row_of
            .try_reserve(max_seqs)
            .map_err(|_| out_of_host_memory(row_index_bytes(max_seqs), &what))?;
        Ok(BatchTable {
            max_blocks_per_seq,
            rows: try_with_capacity(max_seqs, &what)?,
            row_of,
            block_tables: try_filled_vec(cells, NULL_BLOCK as i32, &what)?.into_boxed_slice(),
            context_lens: try_filled_vec(max_seqs, 0, &what)?.into_boxed_slice(),
            slot_mapping: try_filled_vec(max_seqs, PAD_SLOT, &what)?.into_boxed_slice(),
            slabs: try_with_capacity(max_seqs, &what)?,
        })
    }

    /// Host bytes `new` takes for `max_seqs` rows and `cells` block-table entries; `None` on
    /// overflow.
    fn bookkeeping_bytes(max_seqs: usize, cells: usize) -> Option<u64> {
        total_bytes(&[
            array_bytes::<i32>(cells),
            array_bytes::<Row>(max_seqs),
            row_index_bytes(max_seqs),
            array_bytes::<i32>(max_seqs)?.checked_mul(2),
            array_bytes::<u32>(max_seqs),
        ])
    }

    pub fn max_seqs(&self) -> usize {
        self.context_lens.len()
    }

    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_blocks_per_seq
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn contains(&self, seq_id: u64) -> bool {
        self.row_of.contains_key(&seq_id)
    }

    /// Sequence ids by row.
    pub fn seq_ids(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.rows.iter().map(|row| row.seq_id)
    }

    /// `[max_seqs, max_blocks_per_seq]`, row-major, padded with the null block.
    pub fn block_tables(&self) -> &[i32] {
        &self.block_tables
    }

    /// `[max_seqs]`; 0 for unused rows.
    pub fn context_lens(&self) -> &[i32] {
        &self.context_lens
    }

    /// `[max_seqs]`: the slot of each row's last appended token; [`PAD_SLOT`] where none.
    pub fn slot_mapping(&self) -> &[i32] {
        &self.slot_mapping
    }

    fn check_width(&self, seq_id: u64, num_blocks: usize) -> CoreResult<()> {
        ensure!(
            num_blocks <= self.max_blocks_per_seq,
            "sequence {seq_id} needs {num_blocks} blocks; the batch table holds {} per row",
            self.max_blocks_per_seq
        );
        Ok(())
    }

    /// Adds a running sequence as the next row.
    pub fn add(&mut self, cache: &KvCache, seq_id: u64) -> CoreResult<()> {
        ensure!(
            cache.num_groups() == 1,
            "a batch table serves a cache of one layer group; this one has {} (layer_types): \
             use the scheduler's step plan, which has a block table per group",
            cache.num_groups()
        );
        ensure!(
            !self.row_of.contains_key(&seq_id),
            "sequence {seq_id} is already in the batch table"
        );
        ensure!(
            self.rows.len() != self.max_seqs(),
            "the batch table is full ({} rows)",
            self.max_seqs()
        );
        let slab = cache.slab_of(seq_id)?;
        let seq = cache.slab_view(slab);
        ensure!(
            !seq.swapped,
            "sequence {seq_id} is swapped out; swap_in() it first"
        );
        self.check_width(seq_id, seq.blocks.len())?;
        let row = self.rows.len();
        self.rows.push(Row {
            seq_id,
            slab,
            version: 0,
        });
        self.row_of.insert(seq_id, row as u32);
        self.rewrite_row(row, cache);
        self.slot_mapping[row] = PAD_SLOT;
        Ok(())
    }

    /// Removes a sequence's row; the last row moves into the hole.
    pub fn remove(&mut self, seq_id: u64) -> CoreResult<()> {
        let row = self
            .row_of
            .remove(&seq_id)
            .ok_or_else(|| invalid!("sequence {seq_id} is not in the batch table"))?
            as usize;
        let last = self.rows.len() - 1;
        let width = self.max_blocks_per_seq;
        if row != last {
            self.block_tables
                .copy_within(last * width..(last + 1) * width, row * width);
            self.context_lens[row] = self.context_lens[last];
            self.slot_mapping[row] = self.slot_mapping[last];
            self.row_of.insert(self.rows[last].seq_id, row as u32);
        }
        self.rows.swap_remove(row);
        self.block_tables[last * width..(last + 1) * width].fill(NULL_BLOCK as i32);
        self.context_lens[last] = 0;
        self.slot_mapping[last] = PAD_SLOT;
        Ok(())
    }

    /// Removes every row.
    pub fn clear(&mut self) {
        let used = self.rows.len();
        self.block_tables[..used * self.max_blocks_per_seq].fill(NULL_BLOCK as i32);
        self.context_lens[..used].fill(0);
        self.slot_mapping[..used].fill(PAD_SLOT);
        self.rows.clear();
        self.row_of.clear();
    }

    fn rewrite_row(&mut self, row: usize, cache: &KvCache) {
        let seq = cache.slab_view(self.rows[row].slab);
        let width = self.max_blocks_per_seq;
        let cells = &mut self.block_tables[row * width..(row + 1) * width];
        cells.fill(NULL_BLOCK as i32);
        for (cell, &block) in cells.iter_mut().zip(seq.blocks) {
            *cell = block as i32;
        }
        self.context_lens[row] = seq.num_tokens as i32;
        self.rows[row].version = seq.version;
    }

    /// The slab of row `row`'s sequence, refreshing the hint if the sequence moved.
    fn locate(&mut self, row: usize, cache: &KvCache) -> CoreResult<u32> {
        let Row { seq_id, slab, .. } = self.rows[row];
        if cache.slab_view(slab).seq_id == Some(seq_id) {
            return Ok(slab);
        }
        let slab = cache.slab_of(seq_id)?;
        self.rows[row].slab = slab;
        Ok(slab)
    }

    /// Appends one token to every row's sequence (`token_ids[row]` when given) and updates
    /// the buffers in place. All-or-nothing: if any row cannot grow, nothing changes.
    pub fn append_tokens(
        &mut self,
        cache: &mut KvCache,
        token_ids: Option<&[u32]>,
    ) -> CoreResult<()> {
        if let Some(ids) = token_ids {
            ensure!(
                ids.len() == self.rows.len(),
                "token_ids holds {} ids for {} rows",
                ids.len(),
                self.rows.len()
            );
        }
        let block_size = cache.block_size();
        self.slabs.clear();
        for row in 0..self.rows.len() {
            let slab = self.locate(row, cache)?;
            let seq = cache.slab_view(slab);
            let seq_id = self.rows[row].seq_id;
            self.check_width(seq_id, (seq.num_tokens + 1).div_ceil(block_size))?;
            self.slabs.push(slab);
        }
        cache.check_append_budget(&self.slabs, 1)?;
        let width = self.max_blocks_per_seq;
        for row in 0..self.rows.len() {
            let Row { slab, version, .. } = self.rows[row];
            let stale = cache.slab_view(slab).version != version;
            let mut slot = PAD_SLOT;
            let ids = token_ids.map(|ids| std::slice::from_ref(&ids[row]));
            cache.append_to(slab, 1, ids, |_, _, new_slot| slot = new_slot)?;
            self.slot_mapping[row] = slot;
            if stale {
                self.rewrite_row(row, cache);
                continue;
            }
            let seq = cache.slab_view(slab);
            let last = seq.blocks.len() - 1;
            self.block_tables[row * width + last] = seq.blocks[last] as i32;
            self.context_lens[row] = seq.num_tokens as i32;
            self.rows[row].version = seq.version;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::fallible::MAX_BOOKKEEPING_BYTES;

    #[test]
    fn huge_sizes_are_errors_naming_the_argument_not_aborts() {
        let table = BatchTable::new(3, 4).unwrap();
        assert_eq!((table.max_seqs(), table.block_tables().len()), (3, 12));
        // Within the entry limit, but 2**28 rows of bookkeeping are far over the byte limit.
        let message = BatchTable::new(1 << 28, 1).unwrap_err().to_string();
        assert!(
            message.starts_with("max_seqs = 268435456 (with max_blocks_per_seq = 1) would take")
                && message.contains("bytes"),
            "{message}"
        );
        for (max_seqs, width) in [(1 << 40, 1), (1 << 16, 1 << 16), (usize::MAX, usize::MAX)] {
            let message = BatchTable::new(max_seqs, width).unwrap_err().to_string();
            assert!(
                message.contains(&format!(
                    "max_seqs × max_blocks_per_seq = {max_seqs} × {width}"
                )) && message.contains("too large"),
                "{message}"
            );
        }
        let bytes = BatchTable::bookkeeping_bytes(1 << 24, MAX_CELLS).unwrap();
        assert!(bytes <= MAX_BOOKKEEPING_BYTES);
        assert_eq!(BatchTable::bookkeeping_bytes(usize::MAX, 1), None);
        assert_eq!(row_index_bytes(7), Some(8 * 17));
        assert_eq!(row_index_bytes(usize::MAX), None);
    }
}
