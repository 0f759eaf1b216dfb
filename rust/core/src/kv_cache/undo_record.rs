//! The cache as one transaction's unit (see `crate::undo`): each part records its own
//! changes; what is no part's — the pending moves, the sub-block keys waiting to be
//! published, the counters — is kept here when the transaction begins.
//!
//! Debug builds also keep a whole copy at `begin` and check, at every rollback, that the
//! record put back exactly that: a change some part failed to record fails every test that
//! rolls back past it.

use std::fmt;

use super::partial_hits::DeferredSubBlocks;
use super::stats::PrefixStats;
use super::{BlockMove, HostPrefixCounters, KvCache};
use crate::undo::{Saved, Undo};

#[derive(Clone, Default)]
pub(super) struct UndoRecord {
    saved: Saved<(bool, PrefixStats, Option<HostPrefixCounters>)>,
    pending_moves: Vec<BlockMove>,
    deferred_sub_blocks: DeferredSubBlocks,
    #[cfg(debug_assertions)]
    copy: Option<Box<KvCache>>,
}

impl fmt::Debug for UndoRecord {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("_")
    }
}

impl KvCache {
    /// Whether a transaction is open.
    pub(crate) fn in_transaction(&self) -> bool {
        self.undo.saved.is_saved()
    }

    /// The state a rollback must restore, as text (scratch buffers left out).
    #[cfg(debug_assertions)]
    fn state_text(&self) -> String {
        format!(
            "{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}",
            self.block_pool,
            self.host_tier
                .as_ref()
                .map(|tier| (&tier.pool, tier.prefix_counters)),
            self.sequences,
            self.pending_moves,
            self.has_forked,
            self.events,
            self.prefix_stats,
            self.deferred_sub_blocks,
            self.max_seq_tokens,
        )
    }
}

impl Undo for KvCache {
    fn begin(&mut self) {
        debug_assert!(!self.in_transaction(), "transactions do not nest");
        #[cfg(debug_assertions)]
        {
            self.undo.copy = Some(Box::new(self.clone()));
        }
        let counters = self.host_tier.as_ref().map(|tier| tier.prefix_counters);
        self.undo
            .saved
            .save((self.has_forked, self.prefix_stats, counters));
        self.undo.pending_moves.clone_from(&self.pending_moves);
        self.undo
            .deferred_sub_blocks
            .clone_from(&self.deferred_sub_blocks);
        self.block_pool.begin();
        if let Some(tier) = self.host_tier.as_mut() {
            tier.pool.begin();
        }
        self.sequences.begin();
        self.events.begin();
    }

    fn commit(&mut self) {
        self.undo.saved.forget();
        #[cfg(debug_assertions)]
        {
            self.undo.copy = None;
        }
        self.block_pool.commit();
        if let Some(tier) = self.host_tier.as_mut() {
            tier.pool.commit();
        }
        self.sequences.commit();
        self.events.commit();
    }

    fn rollback(&mut self) {
        let Some((has_forked, prefix_stats, counters)) = self.undo.saved.take() else {
            return;
        };
        self.has_forked = has_forked;
        self.prefix_stats = prefix_stats;
        std::mem::swap(&mut self.pending_moves, &mut self.undo.pending_moves);
        std::mem::swap(
            &mut self.deferred_sub_blocks,
            &mut self.undo.deferred_sub_blocks,
        );
        self.block_pool.rollback();
        if let Some(tier) = self.host_tier.as_mut() {
            tier.pool.rollback();
            if let Some(counters) = counters {
                tier.prefix_counters = counters;
            }
        }
        self.sequences.rollback();
        self.events.rollback();
        #[cfg(debug_assertions)]
        if let Some(copy) = self.undo.copy.take() {
            assert_eq!(
                self.state_text(),
                copy.state_text(),
                "the undo record did not restore the cache"
            );
        }
    }
}
