//! The scheduler driven as a server drives it — requests with chunked prefill and prefix
//! hits, both preemption modes, aborts, forks and frees made behind its back, and block
//! moves whose execution fails part-way — with the KV bytes simulated.
//!
//! The simulated memory maps (tier, slot) to the value a token's K/V has there: the runner
//! writes `value(token id, position)` into each planned slot, and executing a move copies a
//! block's slots. After every operation, every position a live sequence claims as computed
//! must hold its value, in the tier the sequence lives on (after the moves still pending,
//! which run before anything reads). A prefix hit on a block that was never computed, moves
//! executed in a wrong order, or a recovery that keeps a damaged sequence all fail it.
//!
//! `ATB_MEM_LONG=1` runs 20,000 cases instead of 1,000.

use std::collections::HashMap;

use atb_mem_core::{
    AttentionKind, BlockHash, BlockMove, ContinuousScheduler, CoreError, EvictionPolicy, KvCache,
    MoveFailure, MoveKind, SchedulerConfig, StepPlan, Tokens, NULL_BLOCK,
};

use proptest::prelude::*;

#[path = "support/chain.rs"]
mod chain;
#[path = "scheduler_model/coverage.rs"]
mod coverage;
#[path = "support/event_mirror.rs"]
mod event_mirror;
#[path = "scheduler_model/faults.rs"]
mod faults;
#[path = "scheduler_model/forks.rs"]
mod forks;
#[path = "support/state.rs"]
mod state;
#[path = "scheduler_model/states.rs"]
mod states;
#[path = "scheduler_model/tiers.rs"]
mod tiers;
#[path = "scheduler_model/turns.rs"]
mod turns;
#[path = "scheduler_model/workload.rs"]
mod workload;
use event_mirror::EventMirror;
use state::state;
use workload::*;

fn all_full(kinds: &[AttentionKind]) -> bool {
    kinds.iter().all(|kind| *kind == AttentionKind::Full)
}

struct Harness {
    cache: KvCache,
    scheduler: ContinuousScheduler,
    memory: Memory,
    /// Ids of each request: prompt then sampled (None for a counted prompt).
    ids: HashMap<u64, Vec<Option<u32>>>,
    forks: Vec<u64>,
    /// Samples each request was added with and has not forked yet.
    planned_forks: HashMap<u64, usize>,
    plan: StepPlan,
    next_id: u64,
    counts: Counts,
    events: EventMirror,
    host_prefix: bool,
    /// A lower tier (a store shared across engines): the contents of every block a request
    /// computed, by hash, offered to later requests and loaded asynchronously.
    store: Option<HashMap<BlockHash, Vec<u64>>>,
    /// Loads planned and not reported yet: (request, [(device block, hash)]).
    loads: Vec<(u64, Vec<(u32, BlockHash)>)>,
    /// The tokens of requests that ended, which a next turn continues (see `turns`).
    ended: Vec<Vec<u32>>,
}

/// What a run exercised, to show the model test is not vacuous.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    copies: usize,
    swaps: usize,
    hit_steps: usize,
    /// Rows whose windowed group had released blocks behind its window.
    windowed_releases: usize,
    failures: usize,
    aborted_by_recovery: usize,
    forked_requests: usize,
    /// Checks after which KV events had named blocks of a group other than the first.
    grouped_events: usize,
    /// Steps that failed over a cache changed behind the scheduler's back.
    tampered_steps: usize,
    /// Host-tier blocks promoted back to the device by prefix hits.
    promotions: u64,
    /// Prompt tokens copied from partly shared blocks (`hash_block_size`).
    partial_hit_tokens: u64,
    /// Of those copies, the ones from an ended sequence's last block, cached by its pieces.
    tail_copies: usize,
    /// Lower-tier loads reported, and of those failed.
    loads: usize,
    failed_loads: usize,
    /// State checkpoints kept, and prompt tokens served by prefix hits.
    checkpoints: u64,
    hit_tokens: u64,
}

impl Harness {
    fn new(
        config: SchedulerConfig,
        layer_kinds: &LayerKinds,
        host_prefix: bool,
        states: Option<states::StateLayers>,
        eviction: Option<(EvictionPolicy, usize)>,
    ) -> Self {
        let (kinds, block_size) = layer_kinds;
        let groups = atb_mem_core::group_layers(kinds).unwrap().0.len();
        // As many slots per group as a one-group cache has in all; with a host prefix cache,
        // fewer, so that the templates' prefixes are evicted and come back.
        let device_blocks = if host_prefix {
            NUM_BLOCKS - 4
        } else {
            NUM_BLOCKS
        };
        let num_blocks = 1 + ((device_blocks - 1) * groups * BLOCK_SIZE).div_ceil(*block_size);
        // With tiers below, a small host tier: the store below it serves what it lets go.
        let host_blocks = if host_prefix && all_full(kinds) {
            3
        } else {
            HOST_BLOCKS
        };
        let mut cache_config = states::config(num_blocks, layer_kinds, states)
            .host_blocks(host_blocks)
            .host_prefix_cache(host_prefix)
            .kv_events(true);
        if let Some((policy, hash_block_size)) = eviction {
            cache_config = cache_config
                .eviction_policy(policy)
                .hash_block_size(hash_block_size);
        }
        let cache = cache_config.build().unwrap();
        let scheduler = ContinuousScheduler::new(config, &cache).unwrap();
        Harness {
            cache,
            scheduler,
            memory: Memory {
                block_size: *block_size,
                device: HashMap::new(),
                host: HashMap::new(),
            },
            ids: HashMap::new(),
            forks: Vec::new(),
            planned_forks: HashMap::new(),
            plan: StepPlan::default(),
            next_id: 1,
            counts: Counts::default(),
            events: EventMirror::default(),
            host_prefix,
            // Lower tiers serve caches of full-attention layers.
            store: (host_prefix && all_full(kinds) && states.is_none()).then(HashMap::new),
            loads: Vec::new(),
            ended: Vec::new(),
        }
    }

    fn live_requests(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .ids
            .keys()
            .copied()
            .filter(|&id| self.scheduler.contains(id))
            .collect();
        ids.sort_unstable();
        ids
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Add {
                template,
                keep,
                tail,
                by_count,
                max_new,
                samples,
            } => {
                // Three templates, or six with a host prefix cache.
                let template = match self.host_prefix {
                    true => template + 3 * (tail[0] as usize % 2),
                    false => *template,
                };
                let mut prompt: Vec<u32> = TEMPLATES[template][..*keep].to_vec();
                prompt.extend_from_slice(tail);
                let seq_id = self.next_id;
                self.next_id += 1;
                let tokens = match by_count {
                    true => Tokens::Count(prompt.len()),
                    false => Tokens::Ids(&prompt),
                };
                if self
                    .scheduler
                    .add_request(&mut self.cache, seq_id, tokens, *max_new, *samples, 0, 0)
                    .is_ok()
                {
                    self.planned_forks.insert(seq_id, samples - 1);
                    let known = prompt.iter().map(|&t| (!by_count).then_some(t)).collect();
                    self.ids.insert(seq_id, known);
                    if !by_count {
                        self.offer_stored_prefix(seq_id, &prompt);
                    }
                }
            }
            Op::Step { fail } => self.step(*fail),
            Op::Sample { token } => {
                let sample: Vec<u64> = self
                    .plan
                    .sample_seq_ids
                    .iter()
                    .copied()
                    .filter(|&id| self.scheduler.contains(id))
                    .filter(|&id| self.scheduler.progress(id).is_ok())
                    .collect();
                let tokens = vec![*token; sample.len()];
                let mut finished = Vec::new();
                if self
                    .scheduler
                    .on_tokens(&mut self.cache, &sample, &tokens, None, &mut finished)
                    .is_ok()
                {
                    for id in &sample {
                        // Samples not forked at the first token are given up.
                        self.planned_forks.remove(id);
                        // A prompt given as a count has no ids at all, not even sampled ones.
                        let ids = self.ids.get_mut(id).unwrap();
                        let known = ids[0].is_some();
                        ids.push(known.then_some(*token));
                    }
                    for id in finished {
                        self.forget(id);
                    }
                    self.plan.sample_seq_ids.clear();
                }
            }
            Op::Abort { pick } => {
                let live = self.live_requests();
                if let Some(&id) = live.get(pick % live.len().max(1)) {
                    self.scheduler.abort(&mut self.cache, id).unwrap();
                    self.forget(id);
                }
            }
            Op::Fork { pick } => self.fork_behind_its_back(*pick),
            Op::ForkRequest { pick } => self.fork_request(*pick),
            Op::Tamper { pick, how } => self.tamper(*pick, *how),
            Op::FinishLoad { pick, ok } => self.finish_load(*pick, *ok),
            Op::NextTurn {
                pick,
                tail,
                max_new,
            } => self.next_turn(*pick, tail, *max_new),
            Op::FreeFork { pick } => {
                if !self.forks.is_empty() {
                    let child = self.forks.swap_remove(pick % self.forks.len());
                    if self.cache.contains(child) {
                        self.cache.free_sequence(child).unwrap();
                    }
                }
            }
        }
    }

    fn forget(&mut self, seq_id: u64) {
        self.remember_ended(seq_id);
        self.ids.remove(&seq_id);
        self.planned_forks.remove(&seq_id);
    }

    /// One step through the core's transaction, the executor simulated: with `fail`, the
    /// moves before `fail % (k + 1)` land, that one half-writes its destination and the rest
    /// never run (at 0, the executor fails before any). It reports how many may have run,
    /// or, on odd `fail`s, all of them (an executor that cannot tell).
    fn step(&mut self, fail: Option<usize>) {
        let before = (self.scheduler.clone(), self.cache.clone());
        let memory = &mut self.memory;
        let mut reported = None;
        let execute = |moves: &[BlockMove]| {
            let Some(fail) = fail else {
                moves
                    .iter()
                    .for_each(|planned| memory.execute(planned, false));
                return Ok(());
            };
            let at = fail % (moves.len() + 1);
            for planned in &moves[..at.saturating_sub(1)] {
                memory.execute(planned, false);
            }
            if at > 0 {
                memory.execute(&moves[at - 1], true);
            }
            let attempted = if fail % 2 == 1 { moves.len() } else { at };
            reported = Some(attempted);
            Err(MoveFailure { attempted })
        };
        let result = self
            .scheduler
            .step_executing(&mut self.cache, 0, &mut self.plan, execute);
        match result {
            Ok(()) => {
                let mut by_request: Vec<(u64, Vec<(u32, BlockHash)>)> = Vec::new();
                for load in &self.plan.loads {
                    match by_request.last_mut() {
                        Some((seq_id, blocks)) if *seq_id == load.seq_id => {
                            blocks.push((load.block, load.key))
                        }
                        _ => by_request.push((load.seq_id, vec![(load.block, load.key)])),
                    }
                }
                self.loads.extend(by_request);
                for planned in &self.plan.moves {
                    match planned.kind {
                        MoveKind::Copy => self.counts.copies += 1,
                        _ => self.counts.swaps += 1,
                    }
                    let pool = self.cache.block_pool();
                    let from_tail = planned.kind == MoveKind::Copy && pool.is_pieces(planned.src);
                    self.counts.tail_copies += usize::from(from_tail);
                }
                let hit = self.plan.positions.windows(2).any(|pair| pair[1] < pair[0])
                    || self.plan.positions.first().is_some_and(|&p| p > 0);
                self.counts.hit_steps += usize::from(hit);
                self.run_model();
            }
            Err(CoreError::MovesFailed { aborted, .. }) => {
                self.counts.failures += 1;
                self.counts.aborted_by_recovery += aborted.len();
                if reported == Some(0) {
                    // Nothing ran: nothing may be lost, and nothing may differ.
                    assert!(aborted.is_empty(), "{aborted:?}");
                    assert_eq!(
                        state(&self.scheduler, &self.cache),
                        state(&before.0, &before.1)
                    );
                }
                self.check_survivors(&before, &aborted);
                for id in aborted {
                    self.forget(id);
                    self.forks.retain(|&child| child != id);
                }
            }
            Err(error) => panic!("a consistent step failed: {error}"),
        }
    }

    /// Writes each planned token's K/V into its slot, as the model's forward does.
    fn run_model(&mut self) {
        let mut token = 0;
        let plan = &self.plan;
        let rows: Vec<u64> = plan
            .prefill_seq_ids
            .iter()
            .chain(&plan.decode_seq_ids)
            .copied()
            .collect();
        for (row, seq_id) in rows.into_iter().enumerate() {
            let query = self.plan.query_lens[row] as usize;
            let start = self.plan.positions[token] as usize;
            self.advance_state(seq_id, start, query);
            for _ in 0..query {
                let position = self.plan.positions[token] as usize;
                let input = self.plan.input_ids[token];
                let known = self.ids[&seq_id][position];
                assert_eq!(
                    input,
                    known.map_or(-1, |t| t as i32),
                    "input id of {seq_id}"
                );
                for group in 0..self.cache.num_groups() {
                    let at = group * self.plan.num_batched_tokens + token;
                    let slot = self.plan.slot_mapping[at] as usize;
                    self.memory
                        .device
                        .insert(slot, value(seq_id, known, position));
                }
                token += 1;
            }
        }
        assert_eq!(token, self.plan.num_batched_tokens);
        assert_eq!(
            self.plan.slot_mapping.len(),
            token * self.cache.num_groups()
        );
        self.check_windows();
    }

    /// Right after a step, a windowed group of each planned sequence holds exactly the
    /// blocks from the first one its row's first token attends to up to its last computed
    /// token: nothing released early, nothing kept late, nothing taken ahead. A decoding row
    /// holds at most ceil((W - 1) / B) + 1 blocks.
    fn check_windows(&mut self) {
        let block_size = self.cache.block_size();
        let rows = self
            .plan
            .prefill_seq_ids
            .iter()
            .chain(&self.plan.decode_seq_ids);
        let decodes = self.plan.prefill_seq_ids.len();
        for (row, &seq_id) in rows.enumerate() {
            let start = self.plan.positions[self.plan.query_start_loc[row] as usize] as usize;
            let computed = self.cache.num_computed(seq_id).unwrap();
            for (group, spec) in self.cache.groups().iter().enumerate() {
                let table = self.cache.group_block_table(seq_id, group).unwrap();
                // Windowed groups hold the blocks from the row's window to its last computed
                // token (the rest of a prompt comes chunk by chunk); full groups hold all.
                let (first, end) = match spec.kind.span() {
                    Some(_) => (
                        spec.kind.first_needed_block(start, block_size),
                        computed.div_ceil(block_size),
                    ),
                    None => (0, table.len()),
                };
                let held: Vec<bool> = table.iter().map(|&block| block != NULL_BLOCK).collect();
                let expected: Vec<bool> = (0..table.len()).map(|i| first <= i && i < end).collect();
                assert_eq!(
                    held, expected,
                    "sequence {seq_id}, group {group} ({:?}), row from {start}: {table:?}",
                    spec.kind
                );
                let live = end - first;
                self.counts.windowed_releases += usize::from(first > 0);
                if let (true, AttentionKind::SlidingWindow { window }) = (row >= decodes, spec.kind)
                {
                    assert!(live <= (window - 1).div_ceil(block_size) + 1, "{table:?}");
                }
            }
        }
    }

    /// Every computed position of every sequence on the cache holds its value, and the KV
    /// events tell a router exactly which blocks are cached.
    fn check(&mut self) {
        self.events.replay(&mut self.cache);
        self.counts.grouped_events += usize::from(self.events.groups_seen().len() > 1);
        self.scheduler.check_invariants(&self.cache).unwrap();
        let mut memory = self.memory.clone();
        for planned in self.cache.pending_moves() {
            memory.execute(planned, false);
        }
        for seq_id in self.cache.seq_ids() {
            let computed = self.cache.num_computed(seq_id).unwrap();
            let swapped = self.cache.is_swapped(seq_id).unwrap();
            let tier = if swapped {
                &memory.host
            } else {
                &memory.device
            };
            self.check_state(tier, seq_id, computed);
            for (group, spec) in self.cache.groups().iter().enumerate() {
                let blocks = self.cache.group_block_table(seq_id, group).unwrap();
                // What the next token to compute reads must be there; earlier blocks a window
                // released are the null block.
                let needed = spec.kind.first_attended(computed);
                for position in 0..computed {
                    let block = blocks[position / self.cache.block_size()];
                    if block == NULL_BLOCK {
                        assert!(
                            position < needed,
                            "sequence {seq_id} lost position {position}"
                        );
                        continue;
                    }
                    self.check_position(tier, seq_id, block, position);
                }
            }
        }
        self.store_computed();
    }

    fn check_position(&self, tier: &HashMap<usize, u64>, seq_id: u64, block: u32, position: usize) {
        let block_size = self.cache.block_size();
        let slot = block as usize * block_size + position % block_size;
        let held = tier.get(&slot).copied();
        match self.ids.get(&seq_id) {
            Some(ids) => assert_eq!(
                held,
                Some(value(seq_id, ids[position], position)),
                "sequence {seq_id} position {position} (block {block})"
            ),
            // A fork holds its parent's values; the parent may be gone, so only check that
            // nothing was damaged.
            None => assert!(
                held.is_some_and(|v| v != GARBAGE),
                "fork {seq_id} position {position}"
            ),
        }
    }
}

fn run(config: SchedulerConfig, kinds: &LayerKinds, ops: Vec<Op>, host_prefix: bool) -> Counts {
    run_policy(
        config,
        kinds,
        ops,
        host_prefix,
        (EvictionPolicy::Lru, kinds.1),
    )
}

fn run_policy(
    config: SchedulerConfig,
    kinds: &LayerKinds,
    ops: Vec<Op>,
    host_prefix: bool,
    (policy, hash_block_size): (EvictionPolicy, usize),
) -> Counts {
    let eviction = Some((policy, hash_block_size));
    let mut harness = Harness::new(config, kinds, host_prefix, None, eviction);
    let trace = std::env::var("ATB_MEM_TRACE").is_ok();
    for op in &ops {
        if trace {
            eprintln!("{op:?}");
        }
        harness.apply(op);
        if trace {
            harness.trace();
        }
        harness.check();
    }
    let stats = harness.cache.stats();
    harness.counts.promotions = stats.host_prefix.promoted;
    harness.counts.partial_hit_tokens = stats.prefix_cache_partial_hit_tokens;
    harness.counts
}

/// 1,000 cases, 20,000 with `ATB_MEM_LONG=1`; `PROPTEST_CASES` overrides both (CI's
/// valgrind run takes a few).
fn cases() -> u32 {
    if let Some(cases) = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
    {
        return cases;
    }
    match std::env::var("ATB_MEM_LONG").as_deref() {
        Ok("1") => 20_000,
        _ => 1_000,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn scheduler_keeps_every_computed_byte(
        config in config(),
        kinds in layer_kinds(),
        ops in prop::collection::vec(op(), STEPS),
        host_prefix in any::<bool>(),
    ) {
        run(config, &kinds, ops, host_prefix);
    }

    #[test]
    fn scheduler_keeps_every_computed_byte_across_tiers(
        config in config(),
        kinds in layer_kinds(),
        ops in prop::collection::vec(tier_op(), STEPS),
        policy in prop::sample::select(EvictionPolicy::ALL.to_vec()),
    ) {
        run_policy(config, &kinds, ops, true, (policy, kinds.1));
    }

    #[test]
    fn scheduler_keeps_every_state(
        config in config(),
        kinds in states::attention_beside_states(),
        ops in prop::collection::vec(op(), STEPS),
        host_prefix in any::<bool>(),
        states in (1usize..3, 1usize..3, 1usize..3),
    ) {
        states::run_states(config, &kinds, ops, host_prefix, states);
    }
}
