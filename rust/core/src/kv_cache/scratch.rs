//! Buffers the cache reuses from call to call so that hot paths allocate nothing. What they
//! hold lives only for the call that fills them.

use std::fmt;

use crate::alloc::BlockHash;

#[derive(Clone, Default)]
pub(super) struct Scratch {
    /// A lookup's chain hashes, and the blocks it found (per group row).
    pub(super) hashes: Vec<BlockHash>,
    pub(super) blocks: Vec<u32>,
    /// A lookup's sub-block keys, and its partial hit's source block per group.
    pub(super) sub_keys: Vec<BlockHash>,
    pub(super) partial: Vec<u32>,
    /// The checkpoint a lookup's hit resumes from (its state blocks), or one being saved.
    pub(super) checkpoint: Vec<u32>,
    /// The slabs of the batch being worked on (see `SequenceTable::resolve_batch`).
    pub(super) slabs: Vec<u32>,
}

/// Printed as `_`: it holds no state between calls, so a cache's `Debug` (which tests
/// compare before and after a call that must change nothing) leaves it out.
impl fmt::Debug for Scratch {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("_")
    }
}
