//! The block pool as part of a transaction (see `crate::undo`): every array records its
//! changes, and the counters are kept at `begin`.

use super::BlockPool;
use crate::undo::Undo;

impl Undo for BlockPool {
    fn begin(&mut self) {
        self.saved
            .save((self.num_evictable, self.counters, self.num_pieces));
        self.ref_counts.begin();
        self.free_queue.begin();
        self.block_hashes.begin();
        self.cached.begin();
        self.prefix_table.begin();
        self.hits.begin();
        self.removed.begin();
        self.evicted.begin();
        self.sub_blocks.begin();
        self.retention.begin();
    }

    fn commit(&mut self) {
        self.saved.forget();
        self.ref_counts.commit();
        self.free_queue.commit();
        self.block_hashes.commit();
        self.cached.commit();
        self.prefix_table.commit();
        self.hits.commit();
        self.removed.commit();
        self.evicted.commit();
        self.sub_blocks.commit();
        self.retention.commit();
    }

    fn rollback(&mut self) {
        if let Some((num_evictable, counters, num_pieces)) = self.saved.take() {
            (self.num_evictable, self.counters, self.num_pieces) =
                (num_evictable, counters, num_pieces);
        }
        self.ref_counts.rollback();
        self.free_queue.rollback();
        self.block_hashes.rollback();
        self.cached.rollback();
        self.prefix_table.rollback();
        self.hits.rollback();
        self.removed.rollback();
        self.evicted.rollback();
        self.sub_blocks.rollback();
        self.retention.rollback();
    }
}
