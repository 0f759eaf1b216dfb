//! The block pool's own unit tests: allocation order, each eviction policy, sizes.

use super::*;

#[test]
fn allocation_prefers_free_blocks_then_lru_cached() {
    let mut pool = BlockPool::new(5, 4, true).unwrap();
    let blocks: Vec<u32> = (0..4).map(|_| pool.allocate().unwrap()).collect();
    assert_eq!(blocks, [1, 2, 3, 4]);
    assert_eq!(pool.allocate(), None);
    let (h1, h2) = (BlockHash([11, 0]), BlockHash([22, 0]));
    pool.register(1, h1, true);
    pool.register(2, h2, true);
    pool.release(2); // cached, older
    pool.release(1); // cached, newer
    pool.release(3); // free
    assert_eq!(pool.num_free(), 3);
    assert_eq!(pool.num_evictable(), 2);
    assert_eq!(pool.allocate(), Some(3));
    assert_eq!(pool.lookup(h1), Some(1));
    assert_eq!(pool.allocate(), Some(2)); // evicts the least recently used
    assert_eq!(pool.lookup(h2), None);
    assert_eq!(pool.counters().evictions, 1);
    pool.take_hit(1);
    assert_eq!(pool.ref_count(1), 1);
    assert_eq!(pool.num_free(), 0);
    let mut holders = vec![0; 5];
    for block in [1, 2, 3, 4] {
        holders[block] = 1;
    }
    pool.check_invariants(&holders).unwrap();
}

/// Caches blocks 1..=4 under hashes 1..=4, hits `hit` of them once more, releases
/// everything, then allocates `n` blocks: returns what each allocation evicted.
fn evictions(policy: EvictionPolicy, hit: &[u32], n: usize) -> Vec<u32> {
    let mut pool = BlockPool::with_policy(5, 4, true, policy).unwrap();
    let blocks: Vec<u32> = (0..4).map(|_| pool.allocate().unwrap()).collect();
    for &block in &blocks {
        pool.register(block, BlockHash([u64::from(block), 0]), true);
    }
    for &block in blocks.iter().rev() {
        pool.release(block); // block 4 is the least recently used
    }
    for &block in hit {
        pool.take_hit(block);
        pool.release(block);
    }
    let mut holders = vec![0; 5];
    pool.check_invariants(&holders).unwrap();
    let evicted = (0..n).map(|_| pool.allocate().unwrap()).collect();
    for (block, held) in holders.iter_mut().enumerate().skip(1) {
        *held = u32::from(pool.ref_count(block as u32) > 0);
    }
    pool.check_invariants(&holders).unwrap();
    evicted
}

#[test]
fn each_policy_evicts_in_its_order() {
    // LRU: least recently used first; a hit makes a block the most recent.
    assert_eq!(evictions(EvictionPolicy::Lru, &[4], 4), [3, 2, 1, 4]);
    // LFU: the fewest hits first, LRU among equals.
    assert_eq!(evictions(EvictionPolicy::Lfu, &[4, 4, 2], 4), [3, 1, 2, 4]);
    // SLRU: probation (never hit) first, then the protected, LRU in each.
    assert_eq!(evictions(EvictionPolicy::Slru, &[4, 2], 4), [3, 1, 4, 2]);
}

#[test]
fn slru_protects_at_most_its_share() {
    // 4 of 5 blocks (80%) may be protected: hit all four and none falls back.
    assert_eq!(evictions(EvictionPolicy::Slru, &[1, 2, 3, 4], 1), [1]);
    // ⌊6 × 0.8⌋ = 4 of 6: five protected blocks push the least recent back to probation.
    let mut pool = BlockPool::with_policy(6, 4, true, EvictionPolicy::Slru).unwrap();
    let blocks: Vec<u32> = (0..5).map(|_| pool.allocate().unwrap()).collect();
    for &block in &blocks {
        pool.register(block, BlockHash([u64::from(block), 0]), true);
        pool.take_hit(block); // hit while held: protected once released
    }
    for &block in &blocks {
        pool.release(block);
        pool.release(block);
    }
    pool.check_invariants(&[0; 6]).unwrap();
    let order: Vec<u32> = (0..5).map(|_| pool.allocate().unwrap()).collect();
    assert_eq!(
        order, blocks,
        "the demoted first, then the protected by recency"
    );
}

#[test]
fn policies_have_names() {
    for policy in EvictionPolicy::ALL {
        assert_eq!(EvictionPolicy::from_name(policy.name()), Some(policy));
    }
    assert_eq!(EvictionPolicy::from_name("mru"), None);
    assert_eq!(
        EvictionPolicy::ALL.map(EvictionPolicy::name),
        EvictionPolicy::NAMES
    );
    assert_eq!("slru".parse(), Ok(EvictionPolicy::Slru));
    let error = "mru".parse::<EvictionPolicy>().unwrap_err().to_string();
    assert_eq!(
        error,
        "unknown eviction_policy 'mru': one of lru, lfu, slru, priority"
    );
}

#[test]
fn rejects_impossible_sizes() {
    assert!(BlockPool::new(1, 16, true).is_err());
    assert!(BlockPool::new(16, 0, true).is_err());
    assert!(BlockPool::new(1 << 28, 16, true).is_err());
}

#[test]
fn huge_sizes_are_errors_naming_num_blocks_and_bytes() {
    for num_blocks in [MAX_BLOCKS + 1, 1 << 62, usize::MAX] {
        let message = BlockPool::new(num_blocks, 1, true).unwrap_err().to_string();
        assert!(
            message.contains(&format!("num_blocks = {num_blocks}")) && message.contains("bytes"),
            "{message}"
        );
    }
    let queues = EvictionPolicy::Lfu.queues();
    let largest = BlockPool::bookkeeping_bytes(MAX_BLOCKS, MAX_BLOCKS, queues).unwrap();
    assert!(largest <= crate::alloc::fallible::MAX_BOOKKEEPING_BYTES);
    assert_eq!(
        BlockPool::bookkeeping_bytes(usize::MAX, usize::MAX, 1),
        None
    );
}

mod undo {
    use super::*;
    use crate::undo::Undo;
    use proptest::prelude::*;

    /// One pool call, its arguments drawn small so that they collide.
    fn apply(pool: &mut BlockPool, held: &mut Vec<u32>, op: (u8, u64, u8)) {
        let (kind, value, priority) = op;
        let pick = |held: &Vec<u32>| held.get(value as usize % held.len().max(1)).copied();
        match kind % 8 {
            0 | 1 => {
                if let Some(block) = pool.allocate() {
                    held.push(block);
                }
            }
            2 => {
                if let Some(at) = (!held.is_empty()).then(|| value as usize % held.len()) {
                    pool.release(held.swap_remove(at));
                }
            }
            3 => {
                if let Some(block) = pick(held) {
                    let key = BlockHash([value % 7, 1]);
                    if pool.register(block, key, true) {
                        pool.register_sub_blocks(block, &[BlockHash([value % 5, 2])]);
                    }
                }
            }
            4 => {
                if let Some(block) = pool.lookup(BlockHash([value % 7, 1])) {
                    pool.take_hit(block);
                    held.push(block);
                }
            }
            5 => {
                if let Some(block) = pick(held) {
                    pool.retain(block, priority % 4, Some(value % 50), false);
                }
            }
            6 => pool.advance_clock(value % 100),
            _ => {
                if let Some(block) = pick(held) {
                    pool.uncache(block);
                }
            }
        }
    }

    fn ops() -> impl Strategy<Value = Vec<(u8, u64, u8)>> {
        prop::collection::vec((any::<u8>(), 0u64..64, any::<u8>()), 0..60)
    }

    proptest! {
        /// Whatever a transaction did to the pool, rolling it back gives the pool it began
        /// with, as `Debug` prints it (every array, queue link and counter).
        #[test]
        fn rollback_restores_the_pool_exactly(before in ops(), during in ops(), lru in any::<bool>()) {
            let policy = match lru {
                true => EvictionPolicy::Lru,
                false => EvictionPolicy::Priority,
            };
            let mut pool = BlockPool::with_policy(12, 4, true, policy).unwrap();
            pool.enable_sub_blocks(1).unwrap();
            pool.reserve_expiries().unwrap();
            pool.set_record_removed(true);
            let mut held = Vec::new();
            for op in before {
                apply(&mut pool, &mut held, op);
            }
            let snapshot = format!("{pool:?}");
            pool.begin();
            let mut during_held = held.clone();
            for op in during {
                apply(&mut pool, &mut during_held, op);
            }
            pool.rollback();
            prop_assert_eq!(format!("{pool:?}"), snapshot);
            let holders = {
                let mut holders = vec![0u32; 12];
                for &block in &held {
                    holders[block as usize] += 1;
                }
                holders
            };
            pool.check_invariants(&holders).map_err(TestCaseError::fail)?;
        }
    }
}
