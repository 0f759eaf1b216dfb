//! The block pool as part of a transaction (see `crate::undo`): every array records its
//! changes, and the counters are kept at `begin`.

use super::BlockPool;
use crate::undo::Undo;

impl BlockPool {
    /// The parts that record their own changes.
    fn undo_parts(&mut self) -> impl Undo + '_ {
        (
            &mut self.ref_counts,
            &mut self.free_queue,
            &mut self.block_hashes,
            &mut self.cached,
            &mut self.prefix_table,
            &mut self.hits,
            &mut self.removed,
            &mut self.evicted,
            &mut self.sub_blocks,
            &mut self.retention,
        )
    }
}

impl Undo for BlockPool {
    fn begin(&mut self) {
        self.saved
            .save((self.num_evictable, self.counters, self.num_pieces));
        self.undo_parts().begin();
    }

    fn commit(&mut self) {
        self.saved.forget();
        self.undo_parts().commit();
    }

    fn rollback(&mut self) {
        if let Some(saved) = self.saved.take() {
            (self.num_evictable, self.counters, self.num_pieces) = saved;
        }
        self.undo_parts().rollback();
    }
}
