//! The one owner of blocks: the device's block pool, the host tier, the block moves planned
//! between them and the KV events that report what the prefix caches hold. Every feature
//! takes, frees, demotes, promotes and looks up blocks through it, so the rules that tie
//! those together — a device block evicted from the prefix cache is demoted before anything
//! can write it again; a lookup sees the host tier below the device — live in one place.

mod host_tier;

pub use host_tier::HostPrefixCounters;
pub(super) use host_tier::HostTier;

use super::keys::may_demote;
use super::{BlockMove, KvEventLog, MoveKind, NO_BLOCK};
use crate::alloc::{BlockHash, BlockPool};
use crate::error::{CoreError, CoreResult};
use crate::undo::{Kept, Saved, Undo};

/// Marks a prefix-lookup result that is a host block: `HOST_HIT | host_block`. Block ids stay
/// below `MAX_BLOCKS` (under 2**25), so the bit is free.
pub(super) const HOST_HIT: u32 = 1 << 31;

#[derive(Debug, Clone)]
pub(super) struct Tiers {
    pub(super) block_pool: BlockPool,
    /// Where swapped-out sequences' blocks go, once `enable_host_tier` made one.
    pub(super) host_tier: Option<HostTier>,
    /// Block moves decided but not yet executed, in the order they must run.
    pub(super) pending_moves: Vec<BlockMove>,
    /// Prefix-cache membership changes, recorded once `enable_kv_events` was called.
    pub(super) events: KvEventLog,
    undo: TiersUndo,
}

/// What a transaction keeps of the tiers beside what their pools and event log record.
#[derive(Clone, Default)]
struct TiersUndo {
    counters: Saved<Option<HostPrefixCounters>>,
    pending_moves: Vec<BlockMove>,
}

impl std::fmt::Debug for TiersUndo {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("_")
    }
}

impl Tiers {
    pub(super) fn new(block_pool: BlockPool) -> Self {
        Tiers {
            block_pool,
            host_tier: None,
            pending_moves: Vec::new(),
            events: KvEventLog::default(),
            undo: TiersUndo::default(),
        }
    }

    /// Allocates a device block for a sequence. If that evicts a cached block and a host
    /// prefix tier is on, the block's contents are demoted first: a (device → host) move is
    /// planned before anything can write the block again (see `host_prefix`).
    #[inline]
    pub(super) fn allocate_device(&mut self) -> CoreResult<u32> {
        // Callers check the budget first; this is a guard, not a code path.
        let (block, evicted) = self
            .block_pool
            .allocate_evicting()
            .ok_or_else(CoreError::no_block)?;
        if let (Some(key), Some(tier)) = (evicted, self.host_tier.as_mut()) {
            if tier.pool.enable_prefix_caching() && may_demote(key) {
                demote(tier, &mut self.pending_moves, &mut self.events, block, key);
            }
        }
        Ok(block)
    }

    /// Brings host block `copy`, a prefix hit the caller holds, back into a fresh device
    /// block: plans the (host → device) move and lets the host block go. Returns the device
    /// block.
    pub(super) fn promote(&mut self, copy: u32) -> CoreResult<u32> {
        let block = self.allocate_device()?;
        self.pending_moves
            .push(BlockMove::new(MoveKind::ToDevice, copy, block));
        let tier = self.host()?;
        // Read by the move just planned; a later demotion may reuse it after that.
        tier.pool.release(copy);
        tier.prefix_counters.promoted += 1;
        Ok(block)
    }

    /// Where the prefix cache holds `key`: `Some(block)` on the device, `Some(HOST_HIT |
    /// block)` on the host tier, `None` on neither.
    #[inline]
    pub(super) fn lookup(&self, key: BlockHash) -> Option<u32> {
        if let Some(block) = self.block_pool.lookup(key) {
            return Some(block);
        }
        let tier = self.host_tier.as_ref()?;
        tier.pool.lookup(key).map(|block| block | HOST_HIT)
    }

    /// Moves the evictions the pools buffered into the event log (see `sync_removed` of the
    /// cache).
    pub(super) fn sync_removed(&mut self) {
        let Tiers {
            block_pool,
            host_tier,
            events,
            ..
        } = self;
        if events.enabled() {
            block_pool.drain_removed(|key, block| events.removed_from_device(key, block));
            if let Some(tier) = host_tier.as_mut() {
                // The host prefix cache's copies that left it (evicted, or reset).
                tier.pool
                    .drain_removed(|_, block| events.host_block_freed(block));
            }
        }
    }

    /// Moves held block `block` to the other tier in `direction` (a swap; once, however
    /// many sequences share it: the host tier's `scratch_moves` knows where it went) and
    /// releases it; where it went. The caller checked the budget and that a host tier exists.
    pub(super) fn move_block(&mut self, block: u32, direction: MoveKind) -> CoreResult<u32> {
        let out = direction.writes_host();
        let moved = match self.host()?.scratch_moves[block as usize] {
            NO_BLOCK => {
                let moved = match out {
                    true => allocate_checked(&mut self.host()?.pool)?,
                    // A device block this evicts may be demoted to the host tier, after the
                    // moves that read the host blocks released so far.
                    false => self.allocate_device()?,
                };
                self.host()?.scratch_moves[block as usize] = moved;
                self.pending_moves
                    .push(BlockMove::new(direction, block, moved));
                moved
            }
            moved => {
                match out {
                    true => self.host()?.pool.share(moved),
                    false => self.block_pool.share(moved),
                }
                moved
            }
        };
        let Tiers {
            block_pool,
            host_tier,
            events,
            ..
        } = self;
        let tier = host_tier.as_mut().ok_or_else(no_host_tier)?;
        let source = match out {
            true => block_pool,
            false => &mut tier.pool,
        };
        source.release(block);
        if !out && events.enabled() && source.ref_count(block) == 0 {
            events.host_block_freed(block);
        }
        Ok(moved)
    }

    /// Clears the swap scratch of the moves planned from `first_move` on.
    pub(super) fn forget_moved(&mut self, first_move: usize) -> CoreResult<()> {
        let tier = self.host_tier.as_mut().ok_or_else(no_host_tier)?;
        for planned in &self.pending_moves[first_move..] {
            tier.scratch_moves[planned.src as usize] = NO_BLOCK;
        }
        Ok(())
    }

    fn host(&mut self) -> CoreResult<&mut HostTier> {
        self.host_tier.as_mut().ok_or_else(no_host_tier)
    }
}

fn no_host_tier() -> CoreError {
    invalid!("this pool has no host tier (num_host_blocks = 0)")
}

/// The host block of a lookup result that came from the host tier.
#[inline]
pub(super) fn host_block(hit: u32) -> Option<u32> {
    (hit & HOST_HIT != 0 && hit != NO_BLOCK).then_some(hit & !HOST_HIT)
}

/// Takes a block of `pool`, whose budget the caller checked.
#[inline]
pub(super) fn allocate_checked(pool: &mut BlockPool) -> CoreResult<u32> {
    // Callers check the budget first; this is a guard, not a code path.
    pool.allocate().ok_or_else(CoreError::no_block)
}

/// Keeps a copy of evicted device block `block`, cached under `key`, in the host tier.
fn demote(
    tier: &mut HostTier,
    moves: &mut Vec<BlockMove>,
    events: &mut KvEventLog,
    block: u32,
    key: BlockHash,
) {
    let HostTier {
        pool,
        prefix_counters: counters,
        ..
    } = tier;
    if let Some(copy) = pool.lookup(key) {
        pool.touch(copy);
        counters.demotions_skipped += 1;
        return;
    }
    let Some(copy) = pool.allocate() else {
        counters.demotions_dropped += 1;
        return;
    };
    if events.enabled() {
        // The copy this evicted leaves the host first: a block holds one name at a time.
        pool.drain_removed(|_, evicted| events.host_block_freed(evicted));
        events.demoted(block, copy);
    }
    moves.push(BlockMove::new(MoveKind::ToHost, block, copy));
    // Registered before its bytes arrive: moves run in order, so anything that reads the
    // copy (a promotion) is planned, and runs, after this move.
    pool.register(copy, key, false);
    pool.release(copy);
    counters.demoted += 1;
}

impl Tiers {
    /// What a transaction may change but the host tier's counters: the pending moves, kept in
    /// the record, and the parts that record their own changes.
    fn undo_parts(&mut self) -> impl Undo + '_ {
        (
            Kept(&mut self.pending_moves, &mut self.undo.pending_moves),
            &mut self.block_pool,
            self.host_tier.as_mut().map(|tier| &mut tier.pool),
            &mut self.events,
        )
    }
}

impl Undo for Tiers {
    fn begin(&mut self) {
        let counters = self.host_tier.as_ref().map(|tier| tier.prefix_counters);
        self.undo.counters.save(counters);
        self.undo_parts().begin();
    }

    fn commit(&mut self) {
        self.undo.counters.forget();
        self.undo_parts().commit();
    }

    fn rollback(&mut self) {
        let Some(counters) = self.undo.counters.take() else {
            return;
        };
        self.undo_parts().rollback();
        if let (Some(tier), Some(counters)) = (self.host_tier.as_mut(), counters) {
            tier.prefix_counters = counters;
        }
    }
}
