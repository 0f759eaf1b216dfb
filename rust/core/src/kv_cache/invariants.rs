//! Every invariant of the cache and its block pools, checked from scratch (for tests).

use super::{KvCache, Sequence};
use crate::alloc::NULL_BLOCK;

impl KvCache {
    /// Verifies every invariant of the cache and its block pool (for tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut holders = vec![0u32; self.num_blocks()];
        let mut host_holders = vec![0u32; self.num_host_blocks() + 1];
        self.sequences.check_invariants()?;
        for (seq_id, seq) in self.sequences.live() {
            self.check_sequence(seq_id, seq)?;
            let tier = if seq.is_swapped() {
                &mut host_holders
            } else {
                &mut holders
            };
            for block in seq.held_blocks() {
                if block == NULL_BLOCK || block as usize >= tier.len() {
                    return Err(format!("sequence {seq_id} holds invalid block {block}"));
                }
                tier[block as usize] += 1;
            }
        }
        if let Some(tier) = &self.tiers.host_tier {
            tier.check_invariants(&host_holders)?;
        }
        self.tiers.block_pool.check_invariants(&holders)
    }

    /// One sequence's group tables, token bookkeeping and hashes.
    fn check_sequence(&self, seq_id: u64, seq: &Sequence) -> Result<(), String> {
        let block_size = self.block_size();
        if seq.tables().len() != self.groups.len() {
            return Err(format!(
                "sequence {seq_id}: {} group tables",
                seq.tables().len()
            ));
        }
        if seq.state().len() != self.states.blocks_per_seq {
            return Err(format!(
                "sequence {seq_id}: {} state blocks, not {}",
                seq.state().len(),
                self.states.blocks_per_seq
            ));
        }
        for (group, (table, spec)) in seq.tables().iter().zip(&self.groups).enumerate() {
            if seq.num_tokens() == 0
                || table.blocks().len() != seq.num_tokens().div_ceil(block_size)
            {
                return Err(format!(
                    "sequence {seq_id}: {} tokens in {} blocks of group {group}",
                    seq.num_tokens(),
                    table.blocks().len()
                ));
            }
            let nulls = table.blocks().iter().filter(|&&b| b == NULL_BLOCK).count();
            let (released, allocated) = (table.released(), table.allocated());
            let shaped = released <= allocated
                && allocated <= table.blocks().len()
                && table.blocks()[..released].iter().all(|&b| b == NULL_BLOCK)
                && table.blocks()[allocated..].iter().all(|&b| b == NULL_BLOCK)
                && nulls == released + table.blocks().len() - allocated;
            // A window never releases a block the first token still to compute reads, and
            // every computed token's block is allocated; full groups hold every block.
            let needed = spec.kind.first_needed_block(seq.num_computed(), block_size);
            let windowed = spec.kind.is_windowed();
            if !shaped
                || released > needed
                || allocated < seq.num_computed().div_ceil(block_size)
                || (!windowed && !table.complete())
            {
                return Err(format!(
                    "sequence {seq_id}, group {group}: {nulls} null blocks, released \
                     {released}, allocated {allocated} of {}, blocks from {needed} needed",
                    table.blocks().len()
                ));
            }
        }
        if seq.is_hashable()
            && (seq.partial_tokens().len() != seq.num_tokens() % block_size
                || seq.hashes().len() != seq.num_tokens() / block_size)
        {
            return Err(format!(
                "sequence {seq_id}: block ids or hashes out of step"
            ));
        }
        if seq.num_computed() > seq.num_tokens() || seq.num_registered() > seq.num_blocks() {
            return Err(format!(
                "sequence {seq_id}: {} computed of {} tokens, {} registered of {} blocks",
                seq.num_computed(),
                seq.num_tokens(),
                seq.num_registered(),
                seq.num_blocks()
            ));
        }
        Ok(())
    }
}
