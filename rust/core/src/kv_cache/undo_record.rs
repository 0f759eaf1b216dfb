//! The cache as one transaction's unit (see `crate::undo`): each owner records its own
//! changes (the tiers, the sequence table); what is no owner's — the sub-block keys waiting
//! to be published and the prefix counters — is kept here when the transaction begins.
//!
//! Debug builds also keep a whole copy at `begin` and check, at every rollback, that the
//! record put back exactly that: a change some part failed to record fails every test that
//! rolls back past it.

use std::fmt;

use super::partial_hits::DeferredSubBlocks;
use super::stats::PrefixStats;
use super::KvCache;
use crate::undo::{Kept, Saved, Undo};

#[derive(Clone, Default)]
pub(super) struct UndoRecord {
    prefix_stats: Saved<PrefixStats>,
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
        self.undo.prefix_stats.is_saved()
    }

    /// The state a rollback must restore, as text (scratch buffers left out).
    #[cfg(debug_assertions)]
    fn state_text(&self) -> String {
        let tiers = &self.tiers;
        format!(
            "{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}",
            tiers.block_pool,
            tiers
                .host_tier
                .as_ref()
                .map(|tier| (&tier.pool, tier.prefix_counters)),
            self.sequences,
            tiers.pending_moves,
            tiers.events,
            self.prefix_stats,
            self.deferred_sub_blocks,
            self.max_seq_tokens,
        )
    }

    /// What a transaction may change but the prefix statistics: the sub-block keys waiting
    /// to be published, kept in the record, and the owners that record their own changes.
    fn undo_parts(&mut self) -> impl Undo + '_ {
        (
            Kept(
                &mut self.deferred_sub_blocks,
                &mut self.undo.deferred_sub_blocks,
            ),
            &mut self.tiers,
            &mut self.sequences,
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
        self.undo.prefix_stats.save(self.prefix_stats);
        self.undo_parts().begin();
    }

    fn commit(&mut self) {
        self.undo.prefix_stats.forget();
        #[cfg(debug_assertions)]
        {
            self.undo.copy = None;
        }
        self.undo_parts().commit();
    }

    fn rollback(&mut self) {
        let Some(prefix_stats) = self.undo.prefix_stats.take() else {
            return;
        };
        self.prefix_stats = prefix_stats;
        self.undo_parts().rollback();
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
