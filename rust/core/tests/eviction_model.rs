//! Every eviction policy against a simple reference model of it: random allocations,
//! registrations, releases, hits, touches and forgets on a small block pool. After every
//! operation the pool holds exactly the model's cached contents and reference counts, and
//! an allocation takes exactly the block the model says: a free one first (the most
//! recently freed), else the head of the first non-empty evictable queue. No block a holder
//! has is ever evicted. The priority policy's model also gives retention priorities for
//! durations and advances a clock that ends them.

use std::collections::VecDeque;

use atb_mem_core::{
    BlockHash, BlockPool, EvictionPolicy, DEFAULT_PRIORITY, LFU_LEVELS, MAX_PRIORITY,
    PROTECTED_SHARE,
};
use proptest::prelude::*;

const NUM_BLOCKS: usize = 9;
const HASHES: u64 = 7;

#[derive(Debug, Clone)]
enum Op {
    Allocate,
    Register {
        pick: usize,
        hash: u64,
    },
    Release {
        pick: usize,
    },
    Hit {
        hash: u64,
    },
    Touch {
        block: u32,
    },
    Uncache {
        block: u32,
    },
    Retain {
        block: u32,
        priority: u8,
        duration: Option<u64>,
        fresh: bool,
    },
    Advance {
        by: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Allocate),
        3 => (0usize..16, 0..HASHES).prop_map(|(pick, hash)| Op::Register { pick, hash }),
        4 => (0usize..16).prop_map(|pick| Op::Release { pick }),
        3 => (0..HASHES).prop_map(|hash| Op::Hit { hash }),
        1 => (1u32..NUM_BLOCKS as u32).prop_map(|block| Op::Touch { block }),
        1 => (1u32..NUM_BLOCKS as u32).prop_map(|block| Op::Uncache { block }),
        // Few priorities, so that blocks often share one (and the default, and past the top).
        3 => (1u32..NUM_BLOCKS as u32, prop::sample::select(vec![0u8, 35, 60, 100, 110]),
              prop::option::of(0u64..20), any::<bool>())
            .prop_map(|(block, priority, duration, fresh)| Op::Retain {
                block, priority, duration, fresh,
            }),
        1 => (0u64..12).prop_map(|by| Op::Advance { by }),
    ]
}

/// The reference: each evictable block has a queue and a stamp (the order it entered, a
/// block put at a queue's head stamped below all); the victim is the smallest (queue,
/// stamp).
#[derive(Clone)]
struct Model {
    policy: EvictionPolicy,
    refs: Vec<u32>,
    cached: Vec<Option<u64>>,
    hits: Vec<u8>,
    free: VecDeque<u32>,
    evictable: Vec<Option<(usize, i64)>>,
    stamp: i64,
    front_stamp: i64,
    priority: Vec<u8>,
    /// When each block's priority ends (`u64::MAX`: never).
    expires: Vec<u64>,
    clock: u64,
}

impl Model {
    fn new(policy: EvictionPolicy) -> Self {
        Model {
            policy,
            refs: vec![0; NUM_BLOCKS],
            cached: vec![None; NUM_BLOCKS],
            hits: vec![0; NUM_BLOCKS],
            free: (1..NUM_BLOCKS as u32).collect(),
            evictable: vec![None; NUM_BLOCKS],
            stamp: 0,
            front_stamp: 0,
            priority: vec![DEFAULT_PRIORITY; NUM_BLOCKS],
            expires: vec![u64::MAX; NUM_BLOCKS],
            clock: 0,
        }
    }

    fn queue_for(&self, block: u32) -> usize {
        let hits = self.hits[block as usize];
        match self.policy {
            EvictionPolicy::Lru => 1,
            EvictionPolicy::Lfu => 1 + usize::from(hits).min(LFU_LEVELS - 1),
            EvictionPolicy::Slru => 1 + usize::from(hits > 0),
            EvictionPolicy::Priority => 1 + usize::from(self.priority[block as usize]),
        }
    }

    /// The priority policy's retention rules, as `retention` states them.
    fn retain(&mut self, block: u32, priority: u8, duration: Option<u64>, fresh: bool) {
        if self.policy != EvictionPolicy::Priority || self.cached[block as usize].is_none() {
            return;
        }
        let priority = priority.min(MAX_PRIORITY);
        let until = duration.map_or(u64::MAX, |d| self.clock.saturating_add(d));
        let current = self.priority[block as usize];
        let takes = fresh
            || priority > current
            || (priority == current && until > self.expires[block as usize]);
        if !takes {
            return;
        }
        self.priority[block as usize] = priority;
        self.expires[block as usize] = until;
        if priority != current && self.refs[block as usize] == 0 {
            self.enqueue_cached(block);
        }
    }

    fn advance(&mut self, by: u64) {
        self.clock += by;
        let mut ended: Vec<(u64, u32)> = (1..NUM_BLOCKS as u32)
            .filter(|&b| self.expires[b as usize] <= self.clock)
            .map(|b| (self.expires[b as usize], b))
            .collect();
        ended.sort_unstable();
        for (_, block) in ended {
            self.expires[block as usize] = u64::MAX;
            self.priority[block as usize] = DEFAULT_PRIORITY;
            if self.evictable[block as usize].is_some() {
                self.front_stamp -= 1;
                let queue = self.queue_for(block);
                self.evictable[block as usize] = Some((queue, self.front_stamp));
            }
        }
    }

    fn enqueue(&mut self, block: u32, queue: usize) {
        self.stamp += 1;
        self.evictable[block as usize] = Some((queue, self.stamp));
    }

    fn enqueue_cached(&mut self, block: u32) {
        self.enqueue(block, self.queue_for(block));
        if self.policy == EvictionPolicy::Slru {
            let most = (NUM_BLOCKS as f64 * PROTECTED_SHARE) as usize;
            loop {
                let protected: Vec<(i64, u32)> = (0..NUM_BLOCKS as u32)
                    .filter_map(|b| match self.evictable[b as usize] {
                        Some((2, stamp)) => Some((stamp, b)),
                        _ => None,
                    })
                    .collect();
                if protected.len() <= most {
                    break;
                }
                let oldest = protected.iter().min().unwrap().1;
                self.enqueue(oldest, 1);
            }
        }
    }

    fn allocate(&mut self) -> Option<u32> {
        let block = match self.free.pop_front() {
            Some(block) => block,
            None => {
                let victim = (0..NUM_BLOCKS as u32)
                    .filter_map(|b| self.evictable[b as usize].map(|key| (key, b)))
                    .min()?
                    .1;
                self.evictable[victim as usize] = None;
                self.cached[victim as usize] = None;
                victim
            }
        };
        self.refs[block as usize] = 1;
        Some(block)
    }

    fn register(&mut self, block: u32, hash: u64) -> bool {
        if self.cached[block as usize].is_some() || self.cached.contains(&Some(hash)) {
            return false;
        }
        self.cached[block as usize] = Some(hash);
        self.hits[block as usize] = 0;
        self.priority[block as usize] = DEFAULT_PRIORITY;
        self.expires[block as usize] = u64::MAX;
        true
    }

    fn release(&mut self, block: u32) {
        self.refs[block as usize] -= 1;
        if self.refs[block as usize] == 0 {
            match self.cached[block as usize] {
                Some(_) => self.enqueue_cached(block),
                None => self.free.push_front(block),
            }
        }
    }

    fn hit(&mut self, hash: u64) -> Option<u32> {
        let block = self.cached.iter().position(|&c| c == Some(hash))? as u32;
        if self.refs[block as usize] == 0 {
            self.evictable[block as usize] = None;
        }
        self.refs[block as usize] += 1;
        self.hits[block as usize] = self.hits[block as usize].saturating_add(1);
        Some(block)
    }

    fn touch(&mut self, block: u32) {
        if self.refs[block as usize] == 0 && self.cached[block as usize].is_some() {
            self.enqueue_cached(block);
        }
    }

    fn uncache(&mut self, block: u32) {
        if self.cached[block as usize].take().is_some() && self.refs[block as usize] == 0 {
            self.evictable[block as usize] = None;
            self.free.push_front(block);
        }
    }
}

fn run(policy: EvictionPolicy, ops: Vec<Op>) {
    let mut pool = BlockPool::with_policy(NUM_BLOCKS, 4, true, policy).unwrap();
    // What a cache does when a request first asks for a priority.
    pool.keep_priorities().unwrap();
    let mut model = Model::new(policy);
    // One entry per reference a holder has.
    let mut held: Vec<u32> = Vec::new();
    let key = |hash: u64| BlockHash([hash + 1, 7]);
    for op in ops {
        match op {
            Op::Allocate => {
                let (got, expected) = (pool.allocate(), model.allocate());
                assert_eq!(got, expected, "{policy:?} allocates");
                if let Some(block) = got {
                    assert!(!held.contains(&block), "a held block was handed out again");
                    held.push(block);
                }
            }
            Op::Register { pick, hash } => {
                if let Some(&block) = held.get(pick % held.len().max(1)) {
                    let joined = pool.register(block, key(hash), true);
                    assert_eq!(joined, model.register(block, hash));
                }
            }
            Op::Release { pick } => {
                if !held.is_empty() {
                    let block = held.swap_remove(pick % held.len());
                    pool.release(block);
                    model.release(block);
                }
            }
            Op::Hit { hash } => {
                let found = pool.lookup(key(hash));
                if let Some(block) = found {
                    pool.take_hit(block);
                    held.push(block);
                }
                assert_eq!(found, model.hit(hash));
            }
            Op::Touch { block } => {
                pool.touch(block);
                model.touch(block);
            }
            Op::Uncache { block } => {
                pool.uncache(block);
                model.uncache(block);
            }
            Op::Retain {
                block,
                priority,
                duration,
                fresh,
            } => {
                pool.retain(block, priority, duration, fresh);
                model.retain(block, priority, duration, fresh);
            }
            Op::Advance { by } => {
                pool.advance_clock(pool.clock() + by);
                model.advance(by);
            }
        }
        // The whole eviction order, not just the next victim: drain copies of both.
        let (mut drained, mut reference) = (pool.clone(), model.clone());
        loop {
            let victim = drained.allocate();
            assert_eq!(victim, reference.allocate(), "{policy:?}'s eviction order");
            if victim.is_none() {
                break;
            }
        }
        for block in 1..NUM_BLOCKS as u32 {
            if model.cached[block as usize].is_some() {
                let expected = match policy {
                    EvictionPolicy::Priority => model.priority[block as usize],
                    _ => DEFAULT_PRIORITY,
                };
                assert_eq!(pool.priority(block), expected, "block {block}'s priority");
            }
        }
        let mut holders = vec![0u32; NUM_BLOCKS];
        for &block in &held {
            holders[block as usize] += 1;
        }
        pool.check_invariants(&holders).unwrap();
        for block in 1..NUM_BLOCKS as u32 {
            assert_eq!(pool.ref_count(block), model.refs[block as usize]);
        }
        for hash in 0..HASHES {
            let expected = model.cached.iter().position(|&c| c == Some(hash));
            assert_eq!(
                pool.lookup(key(hash)),
                expected.map(|b| b as u32),
                "hash {hash}"
            );
        }
        assert_eq!(
            pool.num_free(),
            model.free.len() + model.evictable.iter().flatten().count()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(500),
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_policy_matches_its_reference_model(
        policy in prop::sample::select(EvictionPolicy::ALL.to_vec()),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run(policy, ops);
    }
}
