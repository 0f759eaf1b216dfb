//! The sequence table: where every sequence's blocks are kept, and the only place that
//! hands out slabs, ids and versions.
//!
//! Sequences live in a slab whose entries keep their vectors' capacity when a sequence ends,
//! so steady-state churn allocates nothing; the index maps a caller's id to its slab. A
//! version is unique across the cache's life: whatever holds a copy of a block list (a batch
//! table's row) compares versions to know whether it is stale.
//!
//! In a transaction (see `undo`) the table records what it changes: the index's entries,
//! the vacant list, the slabs it adds, and — through `index_mut`, `two_mut`, `with_log` and
//! `vacant_slab`, the only ways to change a sequence — each sequence it hands out for
//! changing, as it was (see `record`).

use std::fmt;
use std::ops::{Index, IndexMut};

use hashbrown::HashMap;

mod changes;
mod record;
mod sequence;

use super::windows::WindowBounds;
use crate::error::{CoreError, CoreResult};
use crate::undo::{Saved, Undo, UndoVec};
pub(super) use record::SequenceLog;
pub use sequence::SEQUENCE_BYTES;
pub(super) use sequence::{GroupTable, Sequence};

#[derive(Clone)]
pub(super) struct SequenceTable {
    slabs: Vec<Sequence>,
    vacant: UndoVec<u32>,
    index: HashMap<u64, u32>,
    next_version: u64,
    /// Set once any fork happened: only then can a shared, partly filled block (and so a
    /// copy-on-write) appear.
    has_forked: bool,
    /// The transaction's record: the slab count and fork flag it began with, each index
    /// entry's value before its first change (newest last), and the sequences it changed.
    saved: Saved<(usize, bool)>,
    index_before: Vec<(u64, Option<u32>)>,
    log: SequenceLog,
    /// Per slab, the number of the transaction that last changed it.
    changed_in: Vec<u64>,
    transaction: u64,
    /// Per slab, the last batch `resolve_batch` saw it in (finds repeats), and that batch.
    scratch_batch_marks: Vec<u64>,
    scratch_batch: u64,
}

impl Default for SequenceTable {
    fn default() -> Self {
        SequenceTable {
            slabs: Vec::new(),
            vacant: UndoVec::default(),
            index: HashMap::new(),
            next_version: 1,
            has_forked: false,
            saved: Saved::default(),
            index_before: Vec::new(),
            log: SequenceLog::default(),
            changed_in: Vec::new(),
            transaction: 0,
            scratch_batch_marks: Vec::new(),
            scratch_batch: 0,
        }
    }
}

impl SequenceTable {
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub(super) fn contains(&self, seq_id: u64) -> bool {
        self.index.contains_key(&seq_id)
    }

    /// Ids of the live sequences, in no particular order.
    pub(super) fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.index.keys().copied()
    }

    /// The live sequences with their ids, in no particular order.
    pub(super) fn live(&self) -> impl Iterator<Item = (u64, &Sequence)> + '_ {
        self.index
            .iter()
            .map(|(&seq_id, &slab)| (seq_id, &self.slabs[slab as usize]))
    }

    #[inline]
    pub(super) fn slab_of(&self, seq_id: u64) -> CoreResult<u32> {
        self.index
            .get(&seq_id)
            .copied()
            .ok_or_else(|| CoreError::unknown_sequence(seq_id))
    }

    #[inline]
    pub(super) fn get(&self, seq_id: u64) -> CoreResult<&Sequence> {
        Ok(&self.slabs[self.slab_of(seq_id)? as usize])
    }

    /// A version no block list has had yet.
    pub(super) fn new_version(&mut self) -> u64 {
        let version = self.next_version;
        self.next_version += 1;
        version
    }

    /// A free slab with one empty table per group, each stamped `version`. It joins the
    /// index with [`SequenceTable::insert`] once its blocks are taken.
    pub(super) fn vacant_slab(&mut self, version: u64, num_groups: usize) -> u32 {
        let slab = self.vacant.pop().unwrap_or_else(|| {
            self.slabs.push(Sequence::default());
            (self.slabs.len() - 1) as u32
        });
        let seq = &mut self[slab];
        debug_assert!(seq.tables.iter().all(|table| table.blocks.is_empty()));
        seq.window_bounds = WindowBounds::default();
        let tables = &mut seq.tables;
        // Exactly one table per group (a plain resize would reserve four at first).
        tables.reserve_exact(num_groups.saturating_sub(tables.len()));
        tables.resize_with(num_groups, GroupTable::default);
        for table in tables.iter_mut() {
            table.reset(version);
        }
        slab
    }

    pub(super) fn insert(&mut self, seq_id: u64, slab: u32) {
        debug_assert!(self.slabs[slab as usize].live);
        let before = self.index.insert(seq_id, slab);
        if self.saved.is_saved() {
            self.index_before.push((seq_id, before));
        }
    }

    /// Takes the sequence out of the index and gives its slab back; the caller empties the
    /// slab (`Sequence::clear`) once it released the blocks.
    pub(super) fn remove(&mut self, seq_id: u64) -> CoreResult<u32> {
        let slab = self
            .index
            .remove(&seq_id)
            .ok_or_else(|| CoreError::unknown_sequence(seq_id))?;
        if self.saved.is_saved() {
            self.index_before.push((seq_id, Some(slab)));
        }
        self.vacant.push(slab);
        Ok(slab)
    }

    /// Resolves a batch of ids into `slabs`, rejecting unknown ids and repeats. Changes
    /// nothing but scratch marks: the caller gives the sequences new versions once its own
    /// checks pass, so a refused batch leaves them as they were.
    pub(super) fn resolve_batch(
        &mut self,
        seq_ids: &[u64],
        slabs: &mut Vec<u32>,
    ) -> CoreResult<()> {
        self.scratch_batch += 1;
        let batch = self.scratch_batch;
        if self.scratch_batch_marks.len() < self.slabs.len() {
            self.scratch_batch_marks.resize(self.slabs.len(), 0);
        }
        slabs.clear();
        for &seq_id in seq_ids {
            let slab = self.slab_of(seq_id)?;
            let mark = &mut self.scratch_batch_marks[slab as usize];
            ensure!(
                *mark != batch,
                "sequence {seq_id} appears twice in the batch"
            );
            *mark = batch;
            slabs.push(slab);
        }
        Ok(())
    }

    /// Two different slabs at once (a fork's parent and child).
    pub(super) fn two_mut(&mut self, a: u32, b: u32) -> (&mut Sequence, &mut Sequence) {
        self.record(a);
        self.record(b);
        let (a, b) = (a as usize, b as usize);
        debug_assert_ne!(a, b);
        if a < b {
            let (low, high) = self.slabs.split_at_mut(b);
            (&mut low[a], &mut high[0])
        } else {
            let (low, high) = self.slabs.split_at_mut(a);
            (&mut high[0], &mut low[b])
        }
    }

    /// Host bytes of the slab and index, excluding the block lists themselves.
    pub(super) fn heap_bytes(&self) -> usize {
        self.slabs.capacity() * std::mem::size_of::<Sequence>()
            + self
                .slabs
                .iter()
                .map(|seq| {
                    (seq.partial_tokens.capacity() + seq.token_ids.capacity()) * 4
                        + seq.tables.capacity() * std::mem::size_of::<GroupTable>()
                })
                .sum::<usize>()
            + self.vacant.capacity() * 4
            + self.index.allocation_size()
    }

    /// That the index, the slab and the vacant list agree (for tests).
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        for (&seq_id, &slab) in &self.index {
            let seq = &self.slabs[slab as usize];
            if !seq.live || seq.seq_id != seq_id {
                return Err(format!(
                    "index entry {seq_id} points at slab {slab} holding {}",
                    seq.seq_id
                ));
            }
        }
        let live = self.slabs.iter().filter(|seq| seq.live).count();
        if live != self.index.len() || live + self.vacant.len() != self.slabs.len() {
            return Err("sequence slab and index disagree".into());
        }
        Ok(())
    }
}

impl SequenceTable {
    /// Begins recording the changes of sequence `slab`, at a transaction's first change of
    /// it. Slabs added by the transaction go as a whole.
    #[inline]
    fn record(&mut self, slab: u32) {
        let Some(&(slabs, _)) = self.saved.peek() else {
            return;
        };
        let index = slab as usize;
        if index < slabs && self.changed_in[index] != self.transaction {
            self.changed_in[index] = self.transaction;
            self.log.first_change(slab, &self.slabs[index]);
        }
    }

    /// Whether any fork happened (see `has_forked`).
    #[inline]
    pub(super) fn has_forked(&self) -> bool {
        self.has_forked
    }

    pub(super) fn mark_forked(&mut self) {
        self.has_forked = true;
    }

    /// Sequence `slab` to change, and the log its in-place changes go to.
    #[inline]
    pub(super) fn with_log(&mut self, slab: u32) -> (&mut Sequence, &mut SequenceLog) {
        self.record(slab);
        (&mut self.slabs[slab as usize], &mut self.log)
    }
}

impl Undo for SequenceTable {
    fn begin(&mut self) {
        self.transaction += 1;
        self.saved.save((self.slabs.len(), self.has_forked));
        if self.changed_in.len() < self.slabs.len() {
            self.changed_in.resize(self.slabs.len(), 0);
        }
        self.vacant.begin();
        self.log.begin();
    }

    fn commit(&mut self) {
        self.saved.forget();
        self.index_before.clear();
        self.log.commit();
        self.vacant.commit();
    }

    fn rollback(&mut self) {
        let Some((slabs, has_forked)) = self.saved.take() else {
            return;
        };
        self.has_forked = has_forked;
        while let Some((seq_id, before)) = self.index_before.pop() {
            match before {
                Some(slab) => self.index.insert(seq_id, slab),
                None => self.index.remove(&seq_id),
            };
        }
        self.log.rollback(&mut self.slabs);
        self.slabs.truncate(slabs);
        // `next_version` stays: versions only need to be unique, and a block table the
        // failed step wrote may already carry the ones it handed out.
        self.vacant.rollback();
    }
}

/// The index printed in id order: a rollback puts back its entries, not their places in
/// the hash table, and no caller depends on those. The next version is left out: a
/// rollback keeps it (see `rollback`).
impl fmt::Debug for SequenceTable {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut index: Vec<(u64, u32)> = self.index.iter().map(|(&id, &slab)| (id, slab)).collect();
        index.sort_unstable();
        formatter
            .debug_struct("SequenceTable")
            .field("slabs", &self.slabs)
            .field("vacant", &self.vacant)
            .field("index", &index)
            .field("has_forked", &self.has_forked)
            .finish()
    }
}

impl Index<u32> for SequenceTable {
    type Output = Sequence;

    #[inline]
    fn index(&self, slab: u32) -> &Sequence {
        &self.slabs[slab as usize]
    }
}

impl IndexMut<u32> for SequenceTable {
    #[inline]
    fn index_mut(&mut self, slab: u32) -> &mut Sequence {
        self.record(slab);
        &mut self.slabs[slab as usize]
    }
}
