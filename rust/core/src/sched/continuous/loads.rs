//! Requests whose prefix is loaded from a tier below the host (a disk tier, a store shared
//! across engines): the loading state (vLLM's `WAITING_FOR_REMOTE_KVS`).
//!
//! The caller looks a request's block hashes up in its lower tiers and offers the scheduler
//! how many leading blocks they hold (`offer_external_prefix`). When the request is admitted,
//! the blocks past the device's and the host's hit that the lower tiers hold are loaded: the
//! request takes its blocks and a seat as any admission does, the plan lists the blocks to
//! load (`StepPlan::loads`, each a device block and its hash) and the request waits, holding
//! them, while the others keep running. Nothing reads those blocks, and they do not join the
//! prefix cache, until the caller reports the load done (`finish_loads`); a failed load is
//! recomputed, never served.
//!
//! **No deadlock.** A loading request holds what its admission took, no more, and leaves the
//! loading state in bounded time: the caller reports every load it was given, done or failed
//! (a backing that cannot tell times out and reports a failure). So every block a load holds
//! comes back, and the scheduler's argument (a request that fits an empty cache runs once
//! the others finish) holds unchanged.

use super::requests::State;
use super::ContinuousScheduler;
use crate::alloc::BlockHash;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::KvCache;

/// One block to load before its request may run: the device block and the hash of its
/// contents (the chain hash of the prompt up to and including it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLoad {
    pub seq_id: u64,
    pub block: u32,
    pub key: BlockHash,
}

/// What lower tiers did for the scheduler since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadCounters {
    /// Requests whose prefix was loaded (loads started).
    pub started: u64,
    /// Blocks loaded and served as computed.
    pub loaded_blocks: u64,
    /// Loads that failed: their blocks were recomputed.
    pub failed: u64,
}

impl ContinuousScheduler {
    /// Says that the lower tiers hold the first `num_blocks` full blocks of waiting request
    /// `seq_id`'s prompt (by its chain hashes). Its admission then loads the part of them
    /// the device and the host do not hold. Needs a cache whose every group attends fully,
    /// and no recurrent layers (a lower tier keeps no state checkpoint to resume from).
    pub fn offer_external_prefix(
        &mut self,
        cache: &KvCache,
        seq_id: u64,
        num_blocks: usize,
    ) -> CoreResult<()> {
        ensure!(
            cache.groups().iter().all(|group| !group.kind.is_windowed()),
            "lower-tier loads serve caches of full-attention layers only"
        );
        ensure!(
            cache.num_state_blocks() == 0,
            "lower-tier loads serve caches without recurrent layers: a loaded prefix would need \
             the recurrent states at its end, which no lower tier keeps"
        );
        let block_size = cache.block_size();
        let request = self.request_mut(seq_id)?;
        ensure!(
            request.state == State::Waiting && request.has_ids,
            "request {seq_id} is not a waiting request with token ids"
        );
        // As for any hit, the last prompt token is computed, never loaded.
        let most = (request.num_tokens() - 1) / block_size;
        ensure!(
            num_blocks <= most,
            "request {seq_id} has {most} full blocks before its last token; {num_blocks} \
             cannot be loaded"
        );
        request.external_blocks = num_blocks;
        Ok(())
    }

    /// Requests waiting for their loads.
    pub fn num_loading(&self) -> usize {
        self.loading.len()
    }

    pub fn load_counters(&self) -> LoadCounters {
        self.load_counters
    }

    /// Starts the loads of just-admitted request `seq_id` if the lower tiers hold more than
    /// the `cached` tokens the device and the host served: its blocks go to `loads`, and it
    /// waits in the loading state. Returns whether it did.
    pub(super) fn start_load(
        &mut self,
        cache: &mut KvCache,
        seq_id: u64,
        cached: usize,
        loads: &mut Vec<BlockLoad>,
    ) -> CoreResult<bool> {
        let block_size = cache.block_size();
        let request = self.request(seq_id)?;
        let from = cached / block_size;
        let to = request.external_blocks;
        if to <= from {
            return Ok(false);
        }
        let blocks = &cache.block_table(seq_id)?[from..to];
        let keys = &request.block_hashes[from..to];
        for (&block, &key) in blocks.iter().zip(keys) {
            loads.push(BlockLoad { seq_id, block, key });
        }
        let request = self.request_mut(seq_id)?;
        request.state = State::Loading;
        request.loading_blocks = to - from;
        // A partial hit's pieces of block `from` come again with the whole block.
        request.num_computed = from * block_size;
        cache.forget_partial_hit(seq_id)?;
        self.loading.push(seq_id);
        self.load_counters.started += 1;
        Ok(true)
    }

    /// Reports the loads of `seq_ids`: `done[i]` says whether request `seq_ids[i]`'s blocks
    /// all arrived intact. A done load's blocks count as computed and join the prefix cache;
    /// a failed one's are recomputed. Either way the request runs from the next step. Ids of
    /// requests aborted while loading free their blocks now. All-or-nothing.
    pub fn finish_loads(
        &mut self,
        cache: &mut KvCache,
        seq_ids: &[u64],
        done: &[bool],
    ) -> CoreResult<()> {
        ensure!(
            seq_ids.len() == done.len(),
            "seq_ids and done must have the same length"
        );
        for (index, &seq_id) in seq_ids.iter().enumerate() {
            let loading = self.loading.contains(&seq_id) || self.abandoned_loads.contains(&seq_id);
            if !loading {
                return Err(invalid!("request {seq_id} has no load in flight"));
            }
            if seq_ids[..index].contains(&seq_id) {
                return Err(invalid!("request {seq_id} appears twice"));
            }
            cache.seq_len_and_tier(seq_id)?;
        }
        let block_size = cache.block_size();
        for (&seq_id, &ok) in seq_ids.iter().zip(done) {
            if let Some(at) = self.abandoned_loads.iter().position(|&id| id == seq_id) {
                self.abandoned_loads.swap_remove(at);
                cache.free_sequence(seq_id)?;
                continue;
            }
            self.loading.retain(|&id| id != seq_id);
            let request = self
                .requests
                .get_mut(&seq_id)
                .ok_or_else(|| CoreError::unknown_sequence(seq_id))?;
            let loaded = std::mem::take(&mut request.loading_blocks);
            if ok {
                request.num_computed += loaded * block_size;
                self.load_counters.loaded_blocks += loaded as u64;
                // Full-attention groups take no block here: marking cannot fail for room.
                cache.mark_computed(seq_id, Some(request.num_computed))?;
            } else {
                // Not offered again: a preempted request recomputes rather than retry it.
                request.external_blocks = 0;
                self.load_counters.failed += 1;
            }
            self.resume(seq_id, State::Running);
        }
        Ok(())
    }
}
