//! What the cache tells routers: turning KV events on, tiers below the host reporting their
//! own, and moving the block pools' buffered removals into the log in the order they happened.

use super::{KvCache, KvEventLog, Medium};
use crate::alloc::BlockHash;
use crate::error::CoreResult;

impl KvCache {
    /// Records prefix-cache membership changes from now on (see [`KvCache::take_kv_events`]):
    /// `KvCacheConfig::kv_events`, applied by `from_config` before any sequence exists.
    pub(super) fn enable_kv_events(&mut self) -> CoreResult<()> {
        ensure!(
            self.sequences.is_empty(),
            "KV events are turned on once, before any sequence exists"
        );
        ensure!(
            self.groups.len() <= usize::from(u16::MAX) + 1,
            "KV events name at most 65,536 KV-cache groups, this cache has {}",
            self.groups.len()
        );
        let host_blocks = self
            .tiers
            .host_tier
            .as_ref()
            .map_or(0, |tier| tier.pool.num_blocks());
        self.tiers
            .events
            .enable(self.tiers.block_pool.num_blocks(), host_blocks)?;
        self.tiers.block_pool.set_record_removed(true);
        self.record_host_prefix_events()
    }

    pub fn kv_events_enabled(&self) -> bool {
        self.tiers.events.enabled()
    }

    /// Records what a tier below the host did, for the routers that read the events: the
    /// blocks `hashes` (a chain after `parent`, over `token_ids`) stored there, or removed
    /// (`token_ids` empty). Its connector calls this; the cache itself never sees those
    /// tiers. Nothing happens without events.
    pub fn record_tier_event(
        &mut self,
        medium: Medium,
        stored: bool,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        token_ids: &[u32],
    ) -> CoreResult<()> {
        ensure!(
            matches!(medium, Medium::Disk | Medium::Store),
            "the cache records its own device and host events; a tier below names disk or store"
        );
        let expected = if stored {
            hashes.len() * self.block_size()
        } else {
            0
        };
        ensure!(
            token_ids.len() == expected,
            "{} blocks {} carry {expected} token ids, got {}",
            hashes.len(),
            if stored { "stored" } else { "removed" },
            token_ids.len()
        );
        if !self.tiers.events.enabled() || hashes.is_empty() {
            return Ok(());
        }
        self.sync_removed();
        match stored {
            true => {
                let root = BlockHash::root(None);
                self.tiers
                    .events
                    .stored_run(medium, 0, parent, root, hashes, token_ids);
            }
            false => hashes
                .iter()
                .for_each(|&hash| self.tiers.events.removed(medium, 0, hash)),
        }
        Ok(())
    }

    /// Hands the events recorded since the last call to `read`, then drops them.
    pub fn take_kv_events<R>(&mut self, read: impl FnOnce(&KvEventLog) -> R) -> R {
        let result = read(self.kv_events());
        self.clear_kv_events();
        result
    }

    /// The events recorded since the last `clear_kv_events`, without dropping them.
    pub fn kv_events(&mut self) -> &KvEventLog {
        self.sync_removed();
        &self.tiers.events
    }

    pub fn clear_kv_events(&mut self) {
        self.tiers.events.clear();
    }

    /// Moves the device's evictions, buffered by the block pool, into the event log: called
    /// before anything else is logged, so the log keeps the order things happened in.
    pub(super) fn sync_removed(&mut self) {
        self.tiers.sync_removed();
    }

    /// With events and a host prefix cache both, the host pool reports the copies that leave
    /// it and the events keep what names each device block (for its demotion's store).
    pub(super) fn record_host_prefix_events(&mut self) -> CoreResult<()> {
        let block_size = self.block_size();
        let num_blocks = self.num_blocks();
        let Some(tier) = self.tiers.host_tier.as_mut() else {
            return Ok(());
        };
        if self.tiers.events.enabled() && tier.pool.enable_prefix_caching() {
            tier.pool.set_record_removed(true);
            self.tiers
                .events
                .keep_device_names(num_blocks, block_size)?;
        }
        Ok(())
    }
}
