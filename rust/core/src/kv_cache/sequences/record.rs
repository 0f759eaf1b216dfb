//! What a transaction changed of the sequences (see `crate::undo`), kept by the sequence
//! table in one log for all of them, so that a sequence itself carries no record.
//!
//! A sequence is recorded at its first change in the transaction: its scalars, its group
//! tables' bounds, the lengths of its lists and the few token ids of its partly filled
//! block. Its lists only grow in between, but for two kinds of change recorded as they
//! happen: a block replaced in place (`GroupTable::set`, `Sequence::set_state`) and lists
//! emptied (`Sequence::clear`, `Sequence::stop_naming`), whose contents are kept. A
//! rollback undoes those, newest first, then cuts every list back to its length and puts
//! the scalars back.

use super::sequence::{Scalars, Sequence};
use crate::alloc::BlockHash;
use crate::kv_cache::retention::RetentionConfig;

/// The list `replaced` names for a sequence's state blocks (groups are numbered from 0).
pub(in crate::kv_cache) const STATE_LIST: u32 = u32::MAX;

#[derive(Clone, Default)]
pub(in crate::kv_cache) struct SequenceLog {
    recording: bool,
    before: Vec<Before>,
    /// Each recorded sequence's group bounds: (released, allocated, layout, length).
    groups: Vec<(usize, usize, u64, usize)>,
    /// Token ids of partly filled blocks, and the contents of emptied lists.
    ids: Vec<u32>,
    hashes: Vec<BlockHash>,
    changes: Vec<Change>,
}

#[derive(Clone)]
struct Before {
    slab: u32,
    scalars: Scalars,
    /// Lengths of `state`, `hashes` and `token_ids`, and how many group tables.
    lens: [u32; 4],
    /// Where its partial tokens and group bounds are kept.
    partial: (u32, u32),
    groups: u32,
    retention: Option<Box<RetentionConfig>>,
}

#[derive(Clone, Copy)]
enum Change {
    Replaced {
        slab: u32,
        list: u32,
        index: u32,
        old: u32,
    },
    /// The lists' contents were kept from `ids[at..]` and `hashes[hashes_at..]`.
    Cleared { slab: u32, at: u32, hashes_at: u32 },
}

impl SequenceLog {
    /// Records `seq` (in slab `slab`) as it is before its first change in the transaction.
    pub(in crate::kv_cache) fn first_change(&mut self, slab: u32, seq: &Sequence) {
        let groups = self.groups.len() as u32;
        for table in &seq.tables {
            let bounds = (table.released, table.allocated, table.layout);
            self.groups
                .push((bounds.0, bounds.1, bounds.2, table.blocks.len()));
        }
        let partial = (self.ids.len() as u32, seq.partial_tokens.len() as u32);
        if !seq.partial_tokens.is_empty() {
            self.ids.extend_from_slice(&seq.partial_tokens);
        }
        let lens = [
            seq.state.len(),
            seq.hashes.len(),
            seq.token_ids.len(),
            seq.tables.len(),
        ];
        let retention = seq.retention.clone();
        self.before.push(Before {
            slab,
            scalars: seq.scalars(),
            lens: lens.map(|len| len as u32),
            partial,
            groups,
            retention,
        });
    }

    /// Entry `index` of list `list` (a group, or `STATE_LIST`) of slab `slab` held `old`.
    #[inline]
    pub(in crate::kv_cache) fn replaced(&mut self, slab: u32, list: u32, index: usize, old: u32) {
        if self.recording {
            let index = index as u32;
            self.changes.push(Change::Replaced {
                slab,
                list,
                index,
                old,
            });
        }
    }

    /// `seq`'s lists are about to be emptied: keeps their contents.
    pub(in crate::kv_cache) fn cleared(&mut self, slab: u32, seq: &Sequence) {
        if !self.recording {
            return;
        }
        let (at, hashes_at) = (self.ids.len() as u32, self.hashes.len() as u32);
        self.changes.push(Change::Cleared {
            slab,
            at,
            hashes_at,
        });
        let lists = seq.tables.iter().map(|table| &table.blocks[..]);
        for list in lists.chain([&seq.state[..], &seq.token_ids[..], &seq.partial_tokens[..]]) {
            self.ids.push(list.len() as u32);
            self.ids.extend_from_slice(list);
        }
        self.hashes.extend_from_slice(&seq.hashes);
        self.ids.push(seq.hashes.len() as u32);
    }

    pub(in crate::kv_cache) fn begin(&mut self) {
        self.recording = true;
    }

    pub(in crate::kv_cache) fn commit(&mut self) {
        self.recording = false;
        self.before.clear();
        self.groups.clear();
        self.ids.clear();
        self.hashes.clear();
        self.changes.clear();
    }

    /// Puts the recorded sequences of `slabs` back as the transaction found them.
    pub(in crate::kv_cache) fn rollback(&mut self, slabs: &mut [Sequence]) {
        while let Some(change) = self.changes.pop() {
            match change {
                Change::Replaced {
                    slab,
                    list,
                    index,
                    old,
                } => {
                    let Some(seq) = slabs.get_mut(slab as usize) else {
                        continue; // a slab the transaction added
                    };
                    let cells = match list {
                        STATE_LIST => &mut seq.state[..],
                        group => &mut seq.tables[group as usize].blocks.0[..],
                    };
                    if let Some(cell) = cells.get_mut(index as usize) {
                        *cell = old;
                    }
                }
                Change::Cleared {
                    slab,
                    at,
                    hashes_at,
                } => {
                    if let Some(seq) = slabs.get_mut(slab as usize) {
                        self.restore_lists(seq, at as usize, hashes_at as usize);
                    }
                }
            }
        }
        for before in self.before.drain(..) {
            let seq = &mut slabs[before.slab as usize];
            seq.set_scalars(before.scalars);
            seq.retention = before.retention;
            let [state, hashes, token_ids, tables] = before.lens.map(|len| len as usize);
            seq.state.truncate(state);
            seq.hashes.truncate(hashes);
            seq.token_ids.truncate(token_ids);
            seq.tables.truncate(tables);
            let groups = &self.groups[before.groups as usize..][..tables];
            for (table, &(released, allocated, layout, len)) in seq.tables.iter_mut().zip(groups) {
                (table.released, table.allocated, table.layout) = (released, allocated, layout);
                table.blocks.0.truncate(len);
            }
            let (start, len) = (before.partial.0 as usize, before.partial.1 as usize);
            seq.partial_tokens.clear();
            seq.partial_tokens
                .extend_from_slice(&self.ids[start..start + len]);
        }
        self.commit();
    }

    /// Puts back the lists `cleared` kept from `ids[at..]` and `hashes[hashes_at..]`.
    fn restore_lists(&self, seq: &mut Sequence, mut at: usize, hashes_at: usize) {
        let mut next = || {
            let len = self.ids[at] as usize;
            let list = &self.ids[at + 1..at + 1 + len];
            at += 1 + len;
            list
        };
        for table in seq.tables.iter_mut() {
            let list = next();
            table.blocks.0.clear();
            table.blocks.0.extend_from_slice(list);
        }
        for target in [&mut seq.state, &mut seq.token_ids, &mut seq.partial_tokens] {
            let list = next();
            target.clear();
            target.extend_from_slice(list);
        }
        let len = self.ids[at] as usize;
        seq.hashes.clear();
        seq.hashes
            .extend_from_slice(&self.hashes[hashes_at..hashes_at + len]);
    }
}
