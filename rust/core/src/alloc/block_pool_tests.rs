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
