//! Block moves: what the core decides and the byte side executes (plan → execute → commit).
//!
//! Every decision that needs bytes moved — a copy-on-write copy, a swap to the host tier and
//! back — is appended to one list in the order it was made. Executing that list in order is
//! always correct: a block is released only after every move that reads it was recorded, and
//! it can be written only by a move recorded after it was handed out again. (Executing copies
//! before swaps, say, is not: a swap-out's freed block may be a later copy's destination.)
//!
//! If executing a list fails part-way, `KvCache::recover_from_failed_moves` rolls the cache
//! back to where it was before the operation and ends exactly the sequences whose bytes the partial
//! execution destroyed, so nothing is left swapped, copied or cached with bytes that were
//! never moved.

use super::KvCache;
use crate::undo::Undo;

/// What a move does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MoveKind {
    /// Device block to device block (copy-on-write).
    Copy = 0,
    /// Device block to host block (swap out).
    ToHost = 1,
    /// Host block to device block (swap in).
    ToDevice = 2,
}

impl MoveKind {
    pub(super) fn reads_host(self) -> bool {
        self == MoveKind::ToDevice
    }

    pub(super) fn writes_host(self) -> bool {
        self == MoveKind::ToHost
    }
}

/// One block's bytes (every layer, K and V) from `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMove {
    pub kind: MoveKind,
    pub src: u32,
    pub dst: u32,
}

impl BlockMove {
    pub fn new(kind: MoveKind, src: u32, dst: u32) -> Self {
        BlockMove { kind, src, dst }
    }
}

/// The moves of one kind as (source, destination) pairs, in execution order.
pub fn pairs_of(moves: &[BlockMove], kind: MoveKind) -> impl Iterator<Item = [u32; 2]> + '_ {
    moves
        .iter()
        .filter(move |planned| planned.kind == kind)
        .map(|planned| [planned.src, planned.dst])
}

impl KvCache {
    /// Takes the moves decided since the last call, in execution order (`out` is cleared
    /// first). Whoever owns the bytes executes them, in order, before any kernel reads or
    /// writes the blocks involved.
    pub fn take_moves(&mut self, out: &mut Vec<BlockMove>) {
        out.clear();
        out.append(&mut self.tiers.pending_moves);
    }

    /// The moves not yet taken.
    pub fn pending_moves(&self) -> &[BlockMove] {
        &self.tiers.pending_moves
    }

    pub fn num_pending_moves(&self) -> usize {
        self.tiers.pending_moves.len()
    }

    /// Rolls back the open transaction (the operation that decided `moves`) after executing
    /// `moves` failed with only the first `attempted` possibly run.
    ///
    /// A block those moves may have written holds garbage now. Moves still pending in the
    /// snapshot run again later and rewrite their destinations (from intact sources), so they
    /// heal what they rewrite; every other damaged block costs its holders their life (their
    /// ids go to `aborted`) and its place in the prefix cache.
    pub(crate) fn recover_from_failed_moves(
        &mut self,
        moves: &[BlockMove],
        attempted: usize,
        aborted: &mut Vec<u64>,
    ) {
        let attempted = attempted.min(moves.len());
        let mut damaged_device = vec![false; self.num_blocks()];
        let mut damaged_host = vec![false; self.num_host_blocks() + 1];
        for planned in &moves[..attempted] {
            match planned.kind.writes_host() {
                true => damaged_host[planned.dst as usize] = true,
                false => damaged_device[planned.dst as usize] = true,
            }
        }
        self.rollback();
        // Replay what is still pending: a destination is rewritten from its source.
        for planned in &self.tiers.pending_moves {
            let source_damaged = match planned.kind.reads_host() {
                true => damaged_host[planned.src as usize],
                false => damaged_device[planned.src as usize],
            };
            match planned.kind.writes_host() {
                true => damaged_host[planned.dst as usize] = source_damaged,
                false => damaged_device[planned.dst as usize] = source_damaged,
            }
        }
        let first_aborted = aborted.len();
        for (seq_id, seq) in self.sequences.live() {
            let damaged = match seq.is_swapped() {
                true => &damaged_host,
                false => &damaged_device,
            };
            if seq.held_blocks().any(|block| damaged[block as usize]) {
                aborted.push(seq_id);
            }
        }
        aborted[first_aborted..].sort_unstable();
        for &seq_id in &aborted[first_aborted..] {
            // Known live: collected from the index above.
            let _ = self.free_sequence(seq_id);
        }
        for (block, _) in damaged_device.iter().enumerate().filter(|(_, &bad)| bad) {
            self.tiers.block_pool.uncache(block as u32);
        }
        // A host prefix copy the failed moves overwrote (a demotion into an evicted copy).
        if let Some(tier) = self.tiers.host_tier.as_mut() {
            for (block, _) in damaged_host.iter().enumerate().filter(|(_, &bad)| bad) {
                tier.pool.uncache(block as u32);
            }
        }
    }
}
