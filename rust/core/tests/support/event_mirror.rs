//! What a router knows from the KV-cache events alone, replayed after every step of the model
//! tests (tests/kv_cache_model.rs, tests/scheduler_model.rs) and checked against the cache.

use std::collections::HashSet;

use atb_mem_core::{group_key, is_checkpoint_key, BlockHash, KvCache, KvEventKind, Medium};

/// What a router knows from the KV-cache events alone: the (group, hash) of every block
/// cached on the device and copied to the host.
#[derive(Default)]
pub struct EventMirror {
    device: HashSet<(u32, BlockHash)>,
    host: HashSet<(u32, BlockHash)>,
    last_event_id: u64,
    /// The chain roots (cache salts) stores may name; empty: any.
    roots: Vec<BlockHash>,
}

// Each test binary uses a part of this file.
#[allow(dead_code)]
impl EventMirror {
    /// A mirror that also checks every store's chain root is one of `roots`.
    pub fn with_roots(roots: Vec<BlockHash>) -> Self {
        EventMirror {
            roots,
            ..EventMirror::default()
        }
    }

    /// Replays the new events; checks each stored block's hash chains over its token ids and
    /// that the mirror then holds exactly what the cache holds, group by group.
    pub fn replay(&mut self, cache: &mut KvCache) {
        let block_size = cache.block_size();
        let host = cache.take_kv_events(|log| {
            for event in log.events() {
                assert_eq!(event.event_id, self.last_event_id + 1, "event ids");
                self.last_event_id = event.event_id;
                let set = match event.medium {
                    Medium::Device => &mut self.device,
                    Medium::Host => &mut self.host,
                    Medium::Disk | Medium::Store => panic!("the cache alone records no lower tier"),
                };
                let hashes = log.hashes(event);
                match event.kind {
                    KvEventKind::BlockStored => {
                        let tokens = log.token_ids(event);
                        assert_eq!(tokens.len(), hashes.len() * block_size);
                        let roots = &self.roots;
                        assert!(roots.is_empty() || roots.contains(&event.root_hash));
                        let mut parent = event.parent_hash.unwrap_or(event.root_hash);
                        for (hash, ids) in hashes.iter().zip(tokens.chunks(block_size)) {
                            assert_eq!(parent.chain(ids), *hash, "{event:?}");
                            let fresh = set.insert((event.group, *hash));
                            assert!(fresh, "{hash:?} of group {} stored twice", event.group);
                            parent = *hash;
                        }
                    }
                    KvEventKind::BlockRemoved => {
                        for hash in hashes {
                            let known = set.remove(&(event.group, *hash));
                            assert!(known, "{hash:?} of group {} removed unstored", event.group);
                        }
                    }
                    KvEventKind::AllBlocksCleared => {
                        self.device.clear();
                        self.host.clear();
                    }
                }
            }
            log.host_hashes()
                .map(|(hash, group)| (group, hash))
                .collect::<HashSet<_>>()
        });
        // State checkpoints are the engine's own: no event names them.
        let cached: HashSet<BlockHash> = cache
            .block_pool()
            .cached_hashes()
            .filter(|&key| !is_checkpoint_key(key))
            .collect();
        let mirrored: HashSet<BlockHash> = self
            .device
            .iter()
            .map(|&(group, hash)| group_key(hash, group as usize))
            .collect();
        assert_eq!(mirrored, cached, "device blocks after the events");
        assert_eq!(self.host, host, "host copies after the events");
    }

    /// The hashes of group `group` the events say the host tier holds.
    pub fn host_hashes(&self, group: u32) -> HashSet<BlockHash> {
        let held = self.host.iter().filter(|&&(g, _)| g == group);
        held.map(|&(_, hash)| hash).collect()
    }

    /// Groups whose blocks the events have named (a run that never stored a windowed group's
    /// block would not test them).
    pub fn groups_seen(&self) -> HashSet<u32> {
        self.device.iter().map(|&(group, _)| group).collect()
    }
}
