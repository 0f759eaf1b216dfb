//! KV-cache events: the changes of prefix-cache membership that a KV-aware router (NVIDIA
//! Dynamo's, llm-d's) replays to know which blocks this engine holds.
//!
//! A block is *stored* when it joins the prefix cache on the device (it was computed and named
//! by its hash), or when the first host-tier copy of a cached block appears (a swap-out);
//! *removed* when the device evicts or forgets it, or when the last host copy goes. *All
//! blocks cleared* replaces the removals of a reset that leaves nothing cached. Replaying the
//! events in order gives exactly the hashes the cache holds, per medium (the property tests
//! check this after every operation).
//!
//! With KV-cache groups every group's blocks are events of their own, named by the chain's
//! hash (the same tokens have the same hash in every group) and the group's index, as vLLM's
//! `group_idx` does; a router that scores prefixes reads one full-attention group.
//!
//! Recording costs one branch per membership change when events are off. When on, events go
//! into three flat buffers (events, their hashes, their token ids) that keep their capacity
//! across drains, so a steady state allocates nothing. Consecutive stores that continue one
//! chain in one group, and consecutive removals in one group, share an event, as vLLM batches
//! them.

use std::fmt;
use std::ops::Range;

use hashbrown::HashMap;

use super::keys::group_key;
use crate::alloc::fallible::try_filled_vec;
use crate::alloc::BlockHash;
use crate::error::CoreResult;
use crate::undo::{Saved, Undo, UndoVec};

/// `device_groups` of a block cached as part of a state checkpoint: no event names it.
const CHECKPOINT_GROUP: u16 = u16::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEventKind {
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
}

/// Where the blocks of an event (or of a prefix hit) live: the cache's own tiers, or the
/// tiers below the host whose events their connector records (`record_tier_event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    Device,
    Host,
    Disk,
    /// A store shared across engines.
    Store,
}

impl Medium {
    pub fn name(self) -> &'static str {
        match self {
            Medium::Device => "device",
            Medium::Host => "host",
            Medium::Disk => "disk",
            Medium::Store => "store",
        }
    }

    /// The medium named `name` (see [`Medium::name`]).
    pub fn from_name(name: &str) -> Option<Medium> {
        [Medium::Device, Medium::Host, Medium::Disk, Medium::Store]
            .into_iter()
            .find(|medium| medium.name() == name)
    }
}

/// One event; its hashes and token ids are read through [`KvEventLog`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// Increases by one per event over the cache's life.
    pub event_id: u64,
    pub kind: KvEventKind,
    pub medium: Medium,
    /// The KV-cache group of the blocks (0 in a cache of one group).
    pub group: u32,
    /// `BlockStored`: the hash of the block before the first stored one; `None` when the
    /// first stored block starts its sequence.
    pub parent_hash: Option<BlockHash>,
    /// `BlockStored`: the root of the hash chain, which names the cache salt (all zero
    /// without one).
    pub root_hash: BlockHash,
    hashes: Range<usize>,
    tokens: Range<usize>,
}

#[derive(Clone, Default)]
pub struct KvEventLog {
    enabled: bool,
    next_event_id: u64,
    events: Vec<KvEvent>,
    hashes: Vec<BlockHash>,
    tokens: Vec<u32>,
    /// Per device block, the group it was cached for (2 bytes a block, so the table stays in
    /// cache): with its key, which the block pool reports, it names an evicted block. A block
    /// is cached again only after its eviction was logged.
    device_groups: UndoVec<u16>,
    /// Per host block, the cached contents it holds a copy of (swapped out, or demoted by
    /// the host prefix cache).
    host_block_hashes: UndoVec<Option<(BlockHash, u32)>>,
    /// With a host prefix cache, what names each cached device block (its hash, parent, root
    /// and token ids, `block_size` per block), so that its demotion can be stored on the
    /// host as a router expects a store: chained, with its tokens.
    device_names: UndoVec<DeviceName>,
    device_tokens: UndoVec<u32>,
    block_size: usize,
    /// How many host blocks hold a copy of each (hash, group).
    host_copies: HashMap<(BlockHash, u32), u32>,
    /// A transaction's record: the next id, the log's lengths and its last event as it
    /// began, and each host copy count before its first change (newest last).
    saved: Saved<(u64, [usize; 3], Option<KvEvent>)>,
    host_copies_before: Vec<((BlockHash, u32), Option<u32>)>,
}

/// What a stored block's event names besides its group.
#[derive(Debug, Clone, Copy, Default)]
struct DeviceName {
    hash: BlockHash,
    parent: Option<BlockHash>,
    root: BlockHash,
}

impl KvEventLog {
    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Starts recording for `device_blocks` device blocks and `host_blocks` host blocks (0
    /// without a host tier).
    pub(super) fn enable(&mut self, device_blocks: usize, host_blocks: usize) -> CoreResult<()> {
        let groups = try_filled_vec(device_blocks, 0, "the groups of the device's cached blocks")?;
        self.device_groups.replace(groups);
        self.enabled = true;
        self.next_event_id = self.next_event_id.max(1);
        self.resize_host_tier(host_blocks)
    }

    pub(super) fn resize_host_tier(&mut self, host_blocks: usize) -> CoreResult<()> {
        if self.enabled {
            let hashes = try_filled_vec(host_blocks, None, "the host tier's events")?;
            self.host_block_hashes.replace(hashes);
        }
        Ok(())
    }

    /// The events recorded since the last [`KvEventLog::clear`], oldest first.
    pub fn events(&self) -> &[KvEvent] {
        &self.events
    }

    pub fn hashes(&self, event: &KvEvent) -> &[BlockHash] {
        &self.hashes[event.hashes.clone()]
    }

    /// `BlockStored`: the token ids of the stored blocks, block after block.
    pub fn token_ids(&self, event: &KvEvent) -> &[u32] {
        &self.tokens[event.tokens.clone()]
    }

    /// Every event's hashes, event after event.
    pub fn all_hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Every event's token ids, event after event.
    pub fn all_token_ids(&self) -> &[u32] {
        &self.tokens
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Drops the recorded events (keeping the buffers' capacity).
    pub fn clear(&mut self) {
        self.events.clear();
        self.hashes.clear();
        self.tokens.clear();
    }

    /// (hash, group) of the blocks with at least one copy on the host tier.
    pub fn host_hashes(&self) -> impl Iterator<Item = (BlockHash, u32)> + '_ {
        self.host_copies.keys().copied()
    }

    fn push(
        &mut self,
        kind: KvEventKind,
        medium: Medium,
        group: u32,
        parent: Option<BlockHash>,
        root: BlockHash,
    ) {
        let (hashes, tokens) = (self.hashes.len(), self.tokens.len());
        self.events.push(KvEvent {
            event_id: self.next_event_id,
            kind,
            medium,
            group,
            parent_hash: parent,
            root_hash: root,
            hashes: hashes..hashes,
            tokens: tokens..tokens,
        });
        self.next_event_id += 1;
    }

    /// Keeps what names every cached device block from now on (see `demoted`): turned on
    /// with events and a host prefix cache both.
    pub(super) fn keep_device_names(
        &mut self,
        device_blocks: usize,
        block_size: usize,
    ) -> CoreResult<()> {
        let what = "the names of the device's cached blocks";
        let names = try_filled_vec(device_blocks, DeviceName::default(), what)?;
        self.device_names.replace(names);
        let slots = device_blocks.saturating_mul(block_size);
        self.device_tokens.replace(try_filled_vec(slots, 0, what)?);
        self.block_size = block_size;
        Ok(())
    }

    /// Device block `block` is cached for `group` (which its removal will be logged under),
    /// named `hash` after `parent` over `token_ids`; the store itself is logged by
    /// `stored_run`.
    #[inline]
    pub(super) fn cached_for(
        &mut self,
        block: u32,
        group: u32,
        (parent, hash, token_ids): (Option<BlockHash>, BlockHash, &[u32]),
        root: BlockHash,
    ) {
        self.device_groups.set(block as usize, group as u16);
        if (block as usize) < self.device_names.len() {
            let name = DeviceName { hash, parent, root };
            self.device_names.set(block as usize, name);
            let start = block as usize * self.block_size;
            if token_ids.len() == self.block_size {
                for (offset, &token) in token_ids.iter().enumerate() {
                    self.device_tokens.set(start + offset, token);
                }
            }
        }
    }

    /// The host prefix cache keeps a copy of evicted device block `block` in host block
    /// `copy`: stored on the host, as a swap-out's copy is.
    pub(super) fn demoted(&mut self, block: u32, copy: u32) {
        let Some(name) = self.device_names.get(block as usize).copied() else {
            return;
        };
        let group = self.device_groups[block as usize];
        if group == CHECKPOINT_GROUP {
            return;
        }
        let group = u32::from(group);
        let start = block as usize * self.block_size;
        let tokens = std::mem::take(&mut self.device_tokens);
        let token_ids = &tokens[start..start + self.block_size];
        self.host_copy_made(copy, group, name.parent, name.root, name.hash, token_ids);
        self.device_tokens = tokens;
    }

    /// Device block `block` joined the cache as part of a state checkpoint, which no event
    /// names (see `state_checkpoints`).
    pub(super) fn checkpoint_cached(&mut self, block: u32) {
        if (block as usize) < self.device_groups.len() {
            self.device_groups.set(block as usize, CHECKPOINT_GROUP);
        }
    }

    /// Device block `block`, cached under `key`, left the prefix cache.
    pub(super) fn removed_from_device(&mut self, key: BlockHash, block: u32) {
        let group = self.device_groups[block as usize];
        if group == CHECKPOINT_GROUP {
            return;
        }
        let group = u32::from(group);
        self.removed(Medium::Device, group, group_key(key, group as usize));
    }

    /// Blocks named `hashes` (a chain: each the child of the one before, the first the child
    /// of `parent`, `None` when it starts its sequence) joined the cache on `medium`.
    pub(super) fn stored_run(
        &mut self,
        medium: Medium,
        group: u32,
        parent: Option<BlockHash>,
        root: BlockHash,
        hashes: &[BlockHash],
        token_ids: &[u32],
    ) {
        let continues = self.events.last().is_some_and(|last| {
            last.kind == KvEventKind::BlockStored
                && last.medium == medium
                && last.group == group
                && last.root_hash == root
                && parent.is_some()
                && self.hashes.get(last.hashes.end.wrapping_sub(1)) == parent.as_ref()
        });
        if !continues {
            self.push(KvEventKind::BlockStored, medium, group, parent, root);
        }
        self.hashes.extend_from_slice(hashes);
        self.tokens.extend_from_slice(token_ids);
        if let Some(last) = self.events.last_mut() {
            last.hashes.end = self.hashes.len();
            last.tokens.end = self.tokens.len();
        }
    }

    /// The block of `group` named `hash` left the cache on `medium`.
    pub(super) fn removed(&mut self, medium: Medium, group: u32, hash: BlockHash) {
        let continues = self.events.last().is_some_and(|last| {
            last.kind == KvEventKind::BlockRemoved && last.medium == medium && last.group == group
        });
        if !continues {
            self.push(
                KvEventKind::BlockRemoved,
                medium,
                group,
                None,
                BlockHash::default(),
            );
        }
        self.hashes.push(hash);
        if let Some(last) = self.events.last_mut() {
            last.hashes.end = self.hashes.len();
        }
    }

    /// Nothing is cached any more, on any medium.
    pub(super) fn all_cleared(&mut self) {
        self.push(
            KvEventKind::AllBlocksCleared,
            Medium::Device,
            0,
            None,
            BlockHash::default(),
        );
    }

    /// Host block `block` now holds a copy of the cached block `hash` of `group`.
    pub(super) fn host_copy_made(
        &mut self,
        block: u32,
        group: u32,
        parent: Option<BlockHash>,
        root: BlockHash,
        hash: BlockHash,
        token_ids: &[u32],
    ) {
        if self.host_block_hashes[block as usize].is_some() {
            return; // shared by several swapped sequences: one copy
        }
        self.host_block_hashes
            .set(block as usize, Some((hash, group)));
        let copies = self.host_copies.entry((hash, group)).or_insert(0);
        if self.saved.is_saved() {
            let before = (*copies > 0).then_some(*copies);
            self.host_copies_before.push(((hash, group), before));
        }
        *copies += 1;
        if *copies == 1 {
            self.stored_run(Medium::Host, group, parent, root, &[hash], token_ids);
        }
    }

    /// Host block `block` was freed.
    pub(super) fn host_block_freed(&mut self, block: u32) {
        let Some(name) = self.host_block_hashes[block as usize] else {
            return;
        };
        self.host_block_hashes.set(block as usize, None);
        if let Some(copies) = self.host_copies.get_mut(&name) {
            if self.saved.is_saved() {
                self.host_copies_before.push((name, Some(*copies)));
            }
            *copies -= 1;
            if *copies == 0 {
                self.host_copies.remove(&name);
                self.removed(Medium::Host, name.1, name.0);
            }
        }
    }

    pub(super) fn has_host_copies(&self) -> bool {
        !self.host_copies.is_empty()
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.events.capacity() * std::mem::size_of::<KvEvent>()
            + self.hashes.capacity() * std::mem::size_of::<BlockHash>()
            + self.tokens.capacity() * 4
            + self.device_groups.capacity() * 2
            + self.host_block_hashes.capacity() * std::mem::size_of::<Option<(BlockHash, u32)>>()
            + self.host_copies.capacity() * (std::mem::size_of::<(BlockHash, u32)>() + 4)
            + self.device_names.capacity() * std::mem::size_of::<DeviceName>()
            + self.device_tokens.capacity() * 4
    }
}

impl KvEventLog {
    /// The parts that record their own changes.
    fn undo_parts(&mut self) -> impl Undo + '_ {
        (
            &mut self.device_groups,
            &mut self.host_block_hashes,
            &mut self.device_names,
            &mut self.device_tokens,
        )
    }
}

impl Undo for KvEventLog {
    fn begin(&mut self) {
        let lens = [self.events.len(), self.hashes.len(), self.tokens.len()];
        self.saved
            .save((self.next_event_id, lens, self.events.last().cloned()));
        self.undo_parts().begin();
    }

    fn commit(&mut self) {
        self.saved.forget();
        self.host_copies_before.clear();
        self.undo_parts().commit();
    }

    fn rollback(&mut self) {
        let Some((next_event_id, [events, hashes, tokens], last)) = self.saved.take() else {
            return;
        };
        self.next_event_id = next_event_id;
        self.events.truncate(events);
        if let (Some(event), Some(last)) = (self.events.last_mut(), last) {
            *event = last;
        }
        self.hashes.truncate(hashes);
        self.tokens.truncate(tokens);
        while let Some((name, before)) = self.host_copies_before.pop() {
            match before {
                Some(copies) => self.host_copies.insert(name, copies),
                None => self.host_copies.remove(&name),
            };
        }
        self.undo_parts().rollback();
    }
}

/// The host copies printed in key order: a rollback puts back the counts, not their places
/// in the hash table.
impl fmt::Debug for KvEventLog {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut host_copies: Vec<_> = self.host_copies.iter().collect();
        host_copies.sort_unstable_by_key(|&(&(hash, group), &copies)| (hash.0, group, copies));
        formatter
            .debug_struct("KvEventLog")
            .field("enabled", &self.enabled)
            .field("next_event_id", &self.next_event_id)
            .field("events", &self.events)
            .field("hashes", &self.hashes)
            .field("tokens", &self.tokens)
            .field("device_groups", &self.device_groups)
            .field("host_block_hashes", &self.host_block_hashes)
            .field("device_names", &self.device_names)
            .field("device_tokens", &self.device_tokens)
            .field("block_size", &self.block_size)
            .field("host_copies", &host_copies)
            .finish()
    }
}
