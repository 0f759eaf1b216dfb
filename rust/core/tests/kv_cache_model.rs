//! Random operation sequences checked against a reference model.
//!
//! The model keeps, for every live sequence, the token value at each position and how many
//! leading positions are computed, and simulates the KV memory itself: a map from slot to the
//! token value written there. Tokens are written only by an explicit `Compute` (a prefill or
//! decode), which then calls `mark_computed`. After each step the cache's invariants must
//! hold and every computed token of every sequence must be readable through the cache's
//! slots. That catches two sequences writing one slot, a prefix hit that serves uncomputed or
//! wrong contents, a copy-on-write that loses or leaks tokens, and moves executed in a wrong
//! order. A failing call must leave the cache exactly as it was.
//!
//! With KV events on, a mirror replays the events after every step, as a router would, and
//! must hold exactly the hashes the cache holds on each medium; every stored block's hash
//! must chain from its parent over the token ids the event carries.

use std::collections::{HashMap, HashSet};

use atb_mem_core::{
    BatchTable, BlockHash, BlockMove, CoreError, EvictionPolicy, KvCache, KvCacheConfig, KvLayout,
    MoveKind, Tokens,
};
use proptest::prelude::*;

#[path = "support/event_mirror.rs"]
mod event_mirror;
use event_mirror::EventMirror;

const BLOCK_SIZE: usize = 3;
const NUM_BLOCKS: usize = 24;
const VOCAB: u32 = 3;
const HOST_BLOCKS: usize = 10;

#[path = "kv_cache_model/ops.rs"]
mod ops;
use ops::{op, tier_op, Op};

#[derive(Default)]
struct Model {
    tokens: HashMap<u64, Vec<u64>>,
    /// Leading positions of each sequence whose K/V was written.
    computed: HashMap<u64, usize>,
    /// (on the host tier, slot) → token value.
    memory: HashMap<(bool, i32), u64>,
    /// Sequences admitted with the cache salt.
    salted: HashSet<u64>,
    next_synthetic: u64,
}

impl Model {
    fn synthetic(&mut self) -> u64 {
        self.next_synthetic += 1;
        (1 << 40) + self.next_synthetic
    }

    /// Executes the pending moves in their order, as a backing does before any kernel runs.
    fn execute_moves(&mut self, cache: &mut KvCache) {
        let mut moves = Vec::new();
        cache.take_moves(&mut moves);
        for BlockMove { kind, src, dst } in moves {
            let (from_host, to_host) = match kind {
                MoveKind::Copy => (false, false),
                MoveKind::ToHost => (false, true),
                MoveKind::ToDevice => (true, false),
            };
            self.copy_blocks(&[[src, dst]], from_host, to_host);
        }
    }

    /// Executes block copies between tiers, as a backing would.
    fn copy_blocks(&mut self, pairs: &[[u32; 2]], from_host: bool, to_host: bool) {
        let bs = BLOCK_SIZE as i32;
        for &[src, dst] in pairs {
            for offset in 0..bs {
                match self
                    .memory
                    .get(&(from_host, src as i32 * bs + offset))
                    .copied()
                {
                    Some(value) => self
                        .memory
                        .insert((to_host, dst as i32 * bs + offset), value),
                    None => self.memory.remove(&(to_host, dst as i32 * bs + offset)),
                };
            }
        }
    }

    fn check(&self, cache: &KvCache) {
        cache.check_invariants().unwrap();
        assert_eq!(cache.num_sequences(), self.tokens.len());
        for (&id, tokens) in &self.tokens {
            assert_eq!(cache.seq_len(id).unwrap(), tokens.len());
            let computed = self.computed[&id];
            assert_eq!(
                cache.num_computed(id).unwrap(),
                computed,
                "seq {id} computed"
            );
            let on_host = cache.is_swapped(id).unwrap();
            let blocks = cache.block_table(id).unwrap();
            for (position, value) in tokens.iter().enumerate().take(computed) {
                let slot = (blocks[position / BLOCK_SIZE] as usize * BLOCK_SIZE
                    + position % BLOCK_SIZE) as i32;
                assert_eq!(
                    self.memory.get(&(on_host, slot)),
                    Some(value),
                    "seq {id} position {position}"
                );
            }
        }
    }
}

type Snapshot = (String, Vec<(u64, usize, Vec<u32>)>, usize, String);

fn snapshot(cache: &KvCache, batch: &BatchTable) -> Snapshot {
    let mut seqs: Vec<_> = cache
        .seq_ids()
        .map(|id| {
            (
                id,
                cache.seq_len(id).unwrap() * 2 + usize::from(cache.is_swapped(id).unwrap()),
                cache.block_table(id).unwrap().to_vec(),
            )
        })
        .collect();
    seqs.sort();
    let batch_state = format!(
        "{:?} {:?} {:?} {:?}",
        batch.seq_ids().collect::<Vec<_>>(),
        batch.block_tables(),
        batch.context_lens(),
        batch.slot_mapping()
    );
    (
        format!("{:?}", cache.stats()),
        seqs,
        cache.num_pending_moves(),
        batch_state,
    )
}

/// Rows are brought up to date by the table's own append; unused rows are always padding.
fn check_batch(cache: &KvCache, batch: &BatchTable, rows_fresh: bool) {
    let width = batch.max_blocks_per_seq();
    for (row, id) in batch.seq_ids().enumerate().filter(|_| rows_fresh) {
        let Ok(blocks) = cache.block_table(id) else {
            continue;
        };
        let cells = &batch.block_tables()[row * width..(row + 1) * width];
        for (column, &cell) in cells.iter().enumerate() {
            assert_eq!(
                cell,
                blocks.get(column).map_or(0, |&block| block as i32),
                "row {row}"
            );
        }
        assert_eq!(batch.context_lens()[row], cache.seq_len(id).unwrap() as i32);
    }
    for row in batch.len()..batch.max_seqs() {
        assert_eq!(batch.context_lens()[row], 0);
        assert!(batch.block_tables()[row * width..(row + 1) * width]
            .iter()
            .all(|&cell| cell == 0));
    }
}

fn run(ops: Vec<Op>, enable_prefix_caching: bool) {
    run_with(ops, enable_prefix_caching, false, false);
}

fn run_with(ops: Vec<Op>, enable_prefix_caching: bool, kv_events: bool, host_prefix: bool) {
    run_policy(
        ops,
        enable_prefix_caching,
        kv_events,
        host_prefix,
        (EvictionPolicy::Lru, BLOCK_SIZE),
    );
}

/// With a host prefix cache the device and the host tier are small, so that cached blocks
/// are evicted (and demoted, and evicted from the host) often. Prefix keys chain every
/// `hash_block_size` tokens.
fn run_policy(
    ops: Vec<Op>,
    enable_prefix_caching: bool,
    kv_events: bool,
    host_prefix: bool,
    (policy, hash_block_size): (EvictionPolicy, usize),
) {
    let num_blocks = if host_prefix { 9 } else { NUM_BLOCKS };
    // A small host tier with a host prefix cache: its copies are evicted too.
    let host_blocks = if host_prefix { 4 } else { HOST_BLOCKS };
    let mut config = KvCacheConfig::new(num_blocks, BLOCK_SIZE, KvLayout::default())
        .prefix_caching(enable_prefix_caching)
        .eviction_policy(policy)
        .host_blocks(host_blocks)
        .host_prefix_cache(host_prefix)
        .kv_events(kv_events);
    if enable_prefix_caching {
        config = config.hash_block_size(hash_block_size);
    }
    let mut cache = config.build().unwrap();
    let mut mirror = kv_events.then(|| {
        EventMirror::with_roots(vec![
            BlockHash::root(None),
            BlockHash::root(Some(b"tenant")),
        ])
    });
    let mut batch = BatchTable::new(4, 5, 1).unwrap();
    let mut model = Model::default();
    for op in ops {
        let before = snapshot(&cache, &batch);
        // A hit's blocks may come from the host tier: it is read once the moves ran.
        let mut hit_to_check = None;
        let result: Result<(), CoreError> = match &op {
            Op::AllocCount { id, count } => cache
                .alloc_sequence(*id, Tokens::Count(*count), None)
                .map(|cached| {
                    assert_eq!(cached, 0);
                    let values: Vec<u64> = (0..*count).map(|_| model.synthetic()).collect();
                    model.tokens.insert(*id, values);
                    model.computed.insert(*id, 0);
                }),
            Op::AllocIds { id, ids, salted } => {
                let salt = salted.then_some(&b"tenant"[..]);
                let predicted = (!ids.is_empty() && !cache.contains(*id))
                    .then(|| cache.can_allocate(Tokens::Ids(ids), salt).unwrap());
                let result = cache.alloc_sequence(*id, Tokens::Ids(ids), salt);
                if let Some(predicted) = predicted {
                    assert_eq!(
                        predicted,
                        result.is_ok(),
                        "can_allocate disagrees with alloc_sequence"
                    );
                }
                result.map(|cached| {
                    assert!(cached < ids.len() && cached % hash_block_size == 0);
                    assert!(enable_prefix_caching || cached == 0);
                    model
                        .tokens
                        .insert(*id, ids.iter().map(|&t| t as u64).collect());
                    if *salted {
                        model.salted.insert(*id);
                    }
                    model.computed.insert(*id, cached);
                    hit_to_check = Some((*id, cached));
                })
            }
            Op::Append {
                ids,
                n,
                with_token_ids,
            } => {
                let token_ids: Vec<u32> = (0..ids.len() * n)
                    .map(|i| (i as u32 * 7 + 1) % VOCAB)
                    .collect();
                let token_ids = with_token_ids.then_some(&token_ids[..]);
                let mut slots = Vec::new();
                cache
                    .append_tokens(ids, *n, token_ids, &mut slots)
                    .map(|()| {
                        assert_eq!(slots.len(), ids.len() * n);
                        for (i, id) in ids.iter().enumerate() {
                            for t in 0..*n {
                                let value = match token_ids {
                                    Some(token_ids) => token_ids[i * n + t] as u64,
                                    None => model.synthetic(),
                                };
                                model.tokens.get_mut(id).unwrap().push(value);
                            }
                        }
                    })
            }
            Op::Fork { parent, child } => cache.fork(*parent, *child).map(|()| {
                let tokens = model.tokens[parent].clone();
                model.tokens.insert(*child, tokens);
                model.computed.insert(*child, model.computed[parent]);
                if model.salted.contains(parent) {
                    model.salted.insert(*child);
                }
            }),
            Op::Free { id } => {
                let result = cache.free_sequence(*id);
                if result.is_ok() {
                    model.tokens.remove(id);
                    model.computed.remove(id);
                    model.salted.remove(id);
                    let _ = batch.remove(*id);
                }
                result
            }
            Op::BatchAdd { id } => batch.add(&cache, *id),
            Op::BatchRemove { id } => batch.remove(*id),
            Op::BatchAppend { with_token_ids } => {
                let row_ids: Vec<u64> = batch.seq_ids().collect();
                let token_ids: Vec<u32> = (0..row_ids.len() as u32).map(|i| i % VOCAB).collect();
                let token_ids = with_token_ids.then_some(&token_ids[..]);
                let result = batch.append_tokens(&mut cache, token_ids);
                if result.is_ok() {
                    for (row, id) in row_ids.iter().enumerate() {
                        let value =
                            token_ids.map_or_else(|| model.synthetic(), |ids| ids[row] as u64);
                        model.tokens.get_mut(id).unwrap().push(value);
                    }
                }
                result
            }
            Op::SwapOut { ids } => cache.swap_out(ids),
            Op::SwapIn { ids } => cache.swap_in(ids),
            Op::Compute { id } => model.compute(&mut cache, *id),
            Op::Reset => {
                cache.reset_prefix_cache();
                Ok(())
            }
        };
        match &result {
            // Pending moves run before anything reads or writes the blocks again.
            Ok(()) => {
                model.execute_moves(&mut cache);
                if let Some((id, cached)) = hit_to_check {
                    model.check_prefix(&cache, id, cached);
                }
            }
            Err(error) => {
                assert_eq!(
                    before,
                    snapshot(&cache, &batch),
                    "{op:?} failed with {error} but changed state"
                );
                if let CoreError::OutOfBlocks { .. } = error {
                    assert_out_of_blocks_is_warranted(&cache, &batch, &op);
                }
                assert!(cache.take_kv_events(|log| log.is_empty()), "{op:?} failed");
            }
        }
        if let Some(mirror) = mirror.as_mut() {
            let mut on_host = model.swapped_block_hashes(&cache);
            on_host.extend(cache.host_cached_hashes());
            mirror.replay(&mut cache);
            assert!(
                mirror.host_hashes(0).is_subset(&on_host),
                "host copies of blocks no swapped sequence or host prefix cache holds"
            );
            if host_prefix {
                let cached: HashSet<BlockHash> = cache.host_cached_hashes().collect();
                assert!(
                    cached.is_subset(&mirror.host_hashes(0)),
                    "host prefix copies the events never stored"
                );
            }
        }
        model.check(&cache);
        check_batch(
            &cache,
            &batch,
            matches!(op, Op::BatchAppend { .. }) && result.is_ok(),
        );
    }
}

/// A batch append that runs out of blocks must really not fit: appending to its sequences one
/// at a time (on a copy) must run out too.
fn assert_out_of_blocks_is_warranted(cache: &KvCache, batch: &BatchTable, op: &Op) {
    let (ids, n): (Vec<u64>, usize) = match op {
        Op::Append { ids, n, .. } => (ids.clone(), *n),
        Op::BatchAppend { .. } => (batch.seq_ids().collect(), 1),
        _ => return,
    };
    let mut probe = cache.clone();
    let mut slots = Vec::new();
    let all_fit = ids
        .iter()
        .all(|&id| probe.append_tokens(&[id], n, None, &mut slots).is_ok());
    assert!(
        !all_fit,
        "{op:?} ran out of blocks, but its appends fit one by one"
    );
}

impl Model {
    /// The hashes of the leading full blocks of known ids of every swapped-out sequence:
    /// what host copies can name. (A fork whose later tokens came as a count still holds its
    /// parent's named blocks: a run of the model found it.)
    fn swapped_block_hashes(&self, cache: &KvCache) -> HashSet<BlockHash> {
        let mut hashes = HashSet::new();
        for (&id, tokens) in &self.tokens {
            if !cache.is_swapped(id).unwrap() {
                continue;
            }
            let salt = self.salted.contains(&id).then_some(&b"tenant"[..]);
            let mut parent = BlockHash::root(salt);
            for block in tokens.chunks_exact(BLOCK_SIZE) {
                let ids: Option<Vec<u32>> = block.iter().map(|&t| u32::try_from(t).ok()).collect();
                let Some(ids) = ids else {
                    break;
                };
                parent = parent.chain(&ids);
                hashes.insert(parent);
            }
        }
        hashes
    }

    /// A prefix hit must serve exactly the tokens the new sequence asked for.
    fn check_prefix(&self, cache: &KvCache, id: u64, cached: usize) {
        let mut slots = Vec::new();
        cache
            .slot_mapping(0, &[id], &[0], &[cached as i64], &mut slots)
            .unwrap();
        for (position, slot) in slots.iter().enumerate() {
            assert_eq!(
                self.memory.get(&(false, *slot)),
                Some(&self.tokens[&id][position]),
                "prefix hit at {position}"
            );
        }
    }

    /// Writes a sequence's uncomputed tokens into their slots, as a prefill or decode does,
    /// then says so with `mark_computed`.
    fn compute(&mut self, cache: &mut KvCache, id: u64) -> Result<(), CoreError> {
        let Some(tokens) = self.tokens.get(&id) else {
            return cache.mark_computed(id, None).map(drop);
        };
        if cache.is_swapped(id)? {
            return cache.mark_computed(id, None).map(drop);
        }
        let (start, end) = (self.computed[&id], tokens.len());
        let mut slots = Vec::new();
        cache.slot_mapping(0, &[id], &[start as i64], &[end as i64], &mut slots)?;
        for (slot, &value) in slots.iter().zip(&tokens[start..]) {
            self.memory.insert((false, *slot), value);
        }
        cache.mark_computed(id, Some(end))?;
        self.computed.insert(id, end);
        Ok(())
    }
}

/// 400 cases; `PROPTEST_CASES` overrides (CI's valgrind run takes a few).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(400)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn matches_model_with_prefix_caching(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, true);
    }

    #[test]
    fn matches_model_without_prefix_caching(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, false);
    }

    #[test]
    fn kv_events_mirror_the_cache(ops in prop::collection::vec(op(), 1..60)) {
        run_with(ops, true, true, false);
    }

    /// Evicted prefix blocks go to the host tier and come back as hits: every hit still
    /// serves exactly the tokens asked for, read after the moves ran.
    #[test]
    fn matches_model_with_a_host_prefix_cache(ops in prop::collection::vec(tier_op(), 1..80)) {
        run_with(ops, true, false, true);
    }

    /// Every eviction policy keeps every computed byte and serves exact hits, with and
    /// without a host tier below, and its evictions are events a router can replay.
    #[test]
    fn matches_model_with_each_eviction_policy(
        ops in prop::collection::vec(tier_op(), 1..80),
        policy in prop::sample::select(EvictionPolicy::ALL.to_vec()),
        host_prefix in any::<bool>(),
    ) {
        run_policy(ops, true, true, host_prefix, (policy, BLOCK_SIZE));
    }

    /// Prefix keys at every token of 3-token blocks: a hit ending inside a block is a copy
    /// of its first tokens, read only after the moves ran, so every hit still serves exactly
    /// the tokens asked for; the events still name whole blocks a router can chain.
    #[test]
    fn matches_model_with_sub_block_hits(
        ops in prop::collection::vec(tier_op(), 1..80),
        policy in prop::sample::select(EvictionPolicy::ALL.to_vec()),
        host_prefix in any::<bool>(),
    ) {
        run_policy(ops, true, true, host_prefix, (policy, 1));
    }

    #[test]
    fn kv_events_mirror_the_cache_with_a_host_prefix_cache(
        ops in prop::collection::vec(tier_op(), 1..60)
    ) {
        run_with(ops, true, true, true);
    }
}

/// Three sequences share a partly filled block and all append in one batch: two copies are
/// needed (the last appender keeps the block), so the batch fits in exactly two free blocks.
#[test]
fn shared_block_is_copied_once_per_extra_holder() {
    for through_batch_table in [false, true] {
        let mut cache = KvCacheConfig::new(4, 4, KvLayout::default())
            .build()
            .unwrap();
        cache.alloc_sequence(1, Tokens::Count(2), None).unwrap();
        cache.fork(1, 2).unwrap();
        cache.fork(1, 3).unwrap();
        assert_eq!(cache.num_free_blocks(), 2);
        if through_batch_table {
            let mut batch = BatchTable::new(3, 2, 1).unwrap();
            for id in [1, 2, 3] {
                batch.add(&cache, id).unwrap();
            }
            batch.append_tokens(&mut cache, None).unwrap();
        } else {
            cache
                .append_tokens(&[1, 2, 3], 1, None, &mut Vec::new())
                .unwrap();
        }
        let mut moves = Vec::new();
        cache.take_moves(&mut moves);
        assert_eq!(moves.len(), 2);
        assert!(moves.iter().all(|planned| planned.kind == MoveKind::Copy));
        assert_eq!(cache.num_free_blocks(), 0);
        cache.check_invariants().unwrap();
        // With one holder not appending, every appender needs its own copy: 2 blocks for 2.
        let mut cache = KvCacheConfig::new(4, 4, KvLayout::default())
            .build()
            .unwrap();
        cache.alloc_sequence(1, Tokens::Count(2), None).unwrap();
        cache.fork(1, 2).unwrap();
        cache.fork(1, 3).unwrap();
        cache
            .append_tokens(&[2, 3], 1, None, &mut Vec::new())
            .unwrap();
        assert_eq!(cache.num_free_blocks(), 0);
    }
}
