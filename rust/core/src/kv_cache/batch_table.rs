//! Persistent decode-step buffers: block tables, context lengths and slot mapping for the
//! running batch, kept at fixed addresses and updated in place.
//!
//! A model runner (and a captured CUDA graph) reads these buffers every step. Rebuilding a
//! padded table per step writes `rows × max_blocks` entries; appending one token changes at
//! most one block id, one length and one slot per row and group, and that is about all this
//! writes: each row of each group's table keeps a memo of what it holds ([`RowMemo`]), so a
//! block released by a window or replaced by other calls (copy-on-write, swap) is rewritten
//! and the rest stays, and the buffers never go stale.

use hashbrown::HashMap;

use crate::alloc::fallible::{
    array_bytes, check_bookkeeping, out_of_host_memory, total_bytes, try_filled_vec,
    try_with_capacity,
};
use crate::alloc::NULL_BLOCK;
use crate::error::CoreResult;
use crate::kv_cache::{KvCache, RowMemo};

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

/// Where row `row` of group `group`'s table sits among all groups' rows.
#[inline]
fn row_index(max_seqs: usize, group: usize, row: usize) -> usize {
    group * max_seqs + row
}

#[derive(Debug, Clone, Copy)]
struct Row {
    seq_id: u64,
    /// Where the sequence sat in the cache's slab when last seen (a hint, checked on use).
    slab: u32,
    /// The sequence's version when the row was last brought up to date.
    version: u64,
}

#[derive(Debug, Clone)]
pub struct BatchTable {
    max_blocks_per_seq: usize,
    num_groups: usize,
    rows: Vec<Row>,
    row_of: HashMap<u64, u32>,
    /// `[groups, max_seqs, max_blocks_per_seq]`.
    block_tables: Box<[i32]>,
    context_lens: Box<[i32]>,
    /// `[groups, max_seqs]`.
    slot_mapping: Box<[i32]>,
    /// What each row of each group's table holds, `[groups, max_seqs]`.
    memos: Box<[RowMemo]>,
    /// Per-step scratch: each row's slab in the cache.
    slabs: Vec<u32>,
}

impl BatchTable {
    /// Buffers for up to `max_seqs` rows of `max_blocks_per_seq` blocks, one table per
    /// KV-cache group of a cache with `num_groups` groups.
    pub fn new(max_seqs: usize, max_blocks_per_seq: usize, num_groups: usize) -> CoreResult<Self> {
        ensure!(max_seqs != 0 && max_blocks_per_seq != 0, "max_seqs and max_blocks_per_seq must be at least 1, got {max_seqs} and {max_blocks_per_seq}");
        ensure!(num_groups != 0, "a batch table needs at least one group");
        let cells = max_seqs
            .checked_mul(max_blocks_per_seq)
            .and_then(|cells| cells.checked_mul(num_groups))
            .filter(|&cells| cells <= MAX_CELLS)
            .ok_or_else(|| {
                invalid!(
                    "max_seqs × max_blocks_per_seq = {max_seqs} × {max_blocks_per_seq} is too \
                     large: over 2**28 block-table entries (in {num_groups} group(s))"
                )
            })?;
        let rows = max_seqs * num_groups; // at most `cells`
        let bytes = check_bookkeeping(Self::bookkeeping_bytes(max_seqs, rows, cells), || {
            let groups = match num_groups {
                1 => String::new(),
                groups => format!(", in {groups} KV-cache groups"),
            };
            format!(
                "max_seqs = {max_seqs} (with max_blocks_per_seq = {max_blocks_per_seq}{groups})"
            )
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
            num_groups,
            rows: try_with_capacity(max_seqs, &what)?,
            row_of,
            block_tables: try_filled_vec(cells, NULL_BLOCK as i32, &what)?.into_boxed_slice(),
            context_lens: try_filled_vec(max_seqs, 0, &what)?.into_boxed_slice(),
            slot_mapping: try_filled_vec(rows, PAD_SLOT, &what)?.into_boxed_slice(),
            memos: try_filled_vec(rows, RowMemo::default(), &what)?.into_boxed_slice(),
            slabs: try_with_capacity(max_seqs, &what)?,
        })
    }

    /// Host bytes `new` takes for `max_seqs` sequences, `rows` table rows (of every group)
    /// and `cells` block-table entries; `None` on overflow.
    fn bookkeeping_bytes(max_seqs: usize, rows: usize, cells: usize) -> Option<u64> {
        total_bytes(&[
            array_bytes::<i32>(cells),
            array_bytes::<Row>(max_seqs),
            row_index_bytes(max_seqs),
            array_bytes::<i32>(max_seqs),
            array_bytes::<i32>(rows),
            array_bytes::<RowMemo>(rows),
            array_bytes::<u32>(max_seqs),
        ])
    }

    pub fn num_groups(&self) -> usize {
        self.num_groups
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

    /// `[groups, max_seqs, max_blocks_per_seq]`, row-major, padded with the null block.
    pub fn block_tables(&self) -> &[i32] {
        &self.block_tables
    }

    /// `[max_seqs]`; 0 for unused rows.
    pub fn context_lens(&self) -> &[i32] {
        &self.context_lens
    }

    /// `[groups, max_seqs]`: the slot of each row's last appended token in each group;
    /// [`PAD_SLOT`] where none.
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

    fn check_groups(&self, cache: &KvCache) -> CoreResult<()> {
        ensure!(
            cache.num_groups() == self.num_groups,
            "the batch table has {} group(s); the cache has {}",
            self.num_groups,
            cache.num_groups()
        );
        Ok(())
    }

    /// Adds a running sequence as the next row.
    pub fn add(&mut self, cache: &KvCache, seq_id: u64) -> CoreResult<()> {
        self.check_groups(cache)?;
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
        self.write_row(row, cache);
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
            self.context_lens[row] = self.context_lens[last];
            self.row_of.insert(self.rows[last].seq_id, row as u32);
        }
        for group in 0..self.num_groups {
            let (from, to) = (self.row_index(group, last), self.row_index(group, row));
            if row != last {
                self.block_tables
                    .copy_within(from * width..(from + 1) * width, to * width);
                self.slot_mapping[to] = self.slot_mapping[from];
                self.memos[to] = self.memos[from];
            }
            self.block_tables[from * width..(from + 1) * width].fill(NULL_BLOCK as i32);
            self.slot_mapping[from] = PAD_SLOT;
            self.memos[from] = RowMemo::default();
        }
        self.rows.swap_remove(row);
        self.context_lens[last] = 0;
        Ok(())
    }

    /// Removes every row.
    pub fn clear(&mut self) {
        let used = self.rows.len();
        let width = self.max_blocks_per_seq;
        for group in 0..self.num_groups {
            let first = self.row_index(group, 0);
            self.block_tables[first * width..(first + used) * width].fill(NULL_BLOCK as i32);
            self.slot_mapping[first..first + used].fill(PAD_SLOT);
            self.memos[first..first + used].fill(RowMemo::default());
        }
        self.context_lens[..used].fill(0);
        self.rows.clear();
        self.row_of.clear();
    }

    #[inline]
    fn row_index(&self, group: usize, row: usize) -> usize {
        row_index(self.max_seqs(), group, row)
    }

    /// Brings row `row` up to date in every group's table (see [`RowMemo`]).
    fn write_row(&mut self, row: usize, cache: &KvCache) {
        let Row { seq_id, slab, .. } = self.rows[row];
        let seq = cache.slab_view(slab);
        let width = self.max_blocks_per_seq;
        for (group, table) in seq.tables.iter().enumerate() {
            let index = self.row_index(group, row);
            let cells = &mut self.block_tables[index * width..(index + 1) * width];
            self.memos[index].update(cells, seq_id, table.row_view());
        }
        self.context_lens[row] = seq.num_tokens as i32;
        self.rows[row].version = seq.version;
    }

    /// Row `row` after an append to a sequence that nothing else changed since the row was
    /// last brought up to date: each group's last cell (a new block, or the copy a
    /// copy-on-write made of the last one) is all that changed.
    fn write_appended(&mut self, row: usize, cache: &KvCache) {
        let seq = cache.slab_view(self.rows[row].slab);
        let width = self.max_blocks_per_seq;
        for (group, table) in seq.tables.iter().enumerate() {
            let index = self.row_index(group, row);
            let cells = &mut self.block_tables[index * width..(index + 1) * width];
            self.memos[index].appended(cells, table.row_view());
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
        self.check_groups(cache)?;
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
        let max_seqs = self.max_seqs();
        for row in 0..self.rows.len() {
            let Row { slab, version, .. } = self.rows[row];
            let unchanged = cache.slab_view(slab).version == version;
            let ids = token_ids.map(|ids| std::slice::from_ref(&ids[row]));
            let slot_mapping = &mut self.slot_mapping;
            cache.append_to(slab, 1, ids, |group, _, slot| {
                slot_mapping[row_index(max_seqs, group, row)] = slot;
            })?;
            match unchanged {
                true => self.write_appended(row, cache),
                false => self.write_row(row, cache),
            }
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
        let table = BatchTable::new(3, 4, 1).unwrap();
        assert_eq!((table.max_seqs(), table.block_tables().len()), (3, 12));
        // Within the entry limit, but 2**28 rows of bookkeeping are far over the byte limit.
        let message = BatchTable::new(1 << 25, 1, 8).unwrap_err().to_string();
        assert!(message.contains("in 8 KV-cache groups"), "{message}");
        let message = BatchTable::new(1 << 28, 1, 1).unwrap_err().to_string();
        assert!(
            message.starts_with("max_seqs = 268435456 (with max_blocks_per_seq = 1) would take")
                && message.contains("bytes"),
            "{message}"
        );
        for (max_seqs, width) in [(1 << 40, 1), (1 << 16, 1 << 16), (usize::MAX, usize::MAX)] {
            let message = BatchTable::new(max_seqs, width, 1).unwrap_err().to_string();
            assert!(
                message.contains(&format!(
                    "max_seqs × max_blocks_per_seq = {max_seqs} × {width}"
                )) && message.contains("too large"),
                "{message}"
            );
        }
        let bytes = BatchTable::bookkeeping_bytes(1 << 24, 1 << 24, MAX_CELLS).unwrap();
        assert!(bytes <= MAX_BOOKKEEPING_BYTES);
        assert_eq!(BatchTable::bookkeeping_bytes(usize::MAX, 1, 1), None);
        assert_eq!(row_index_bytes(7), Some(8 * 17));
        assert_eq!(row_index_bytes(usize::MAX), None);
    }
}
