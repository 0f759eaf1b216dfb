//! Continuous batching over a [`KvCache`] (what Orca and vLLM's scheduler do), as a
//! deterministic policy: the caller passes the time and the cache; every decision of a step
//! comes back as one [`StepPlan`].
//!
//! Each step serves, in this order and within `max_num_batched_tokens` and `max_num_seqs`:
//! 1. running sequences: a decode token each, or the next chunk of an unfinished prefill. A
//!    decode that needs a block when none is free preempts the newest, lowest-priority running
//!    sequence (possibly itself): `Recompute` frees its blocks and puts it at the front of the
//!    queue, `Swap` moves it to the cache's host tier;
//! 2. swapped-out sequences, swapped back in while blocks (beyond the watermark) allow;
//! 3. waiting requests, admitted by priority then arrival while their whole prompt's blocks
//!    (beyond the watermark) are there; prefix-cache hits count as computed.
//!
//! Nothing new is admitted while anything waits to resume, so a preempted sequence always
//! comes back before later arrivals: none starves. A sequence whose last token was computed
//! waits for its sampled token (`on_tokens`) before it is scheduled again.
//!
//! **The contract.** A plan returned by `step()` is executed — every row, even of requests
//! aborted in the meantime — before the next `step()` or `on_tokens()`. Its block moves come
//! first, in their order (the Python binding executes them inside `step()`, under the cache's
//! lock). Scheduled tokens therefore count as computed when planned, and the full blocks they
//! complete join the prefix cache then. Requests admitted later in the same step may hit those
//! blocks (vLLM's rule): safe only because a batched forward writes every token's K/V, layer
//! by layer, before any attention of that layer reads. Sampled tokens extend a request's
//! token history, so its output blocks are reusable by a follow-up request.

use std::collections::BTreeSet;

use hashbrown::HashMap;

use crate::block_move::BlockMove;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::{KvCache, Tokens};
use crate::step_tables::BlockTableWriter;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    Recompute,
    Swap,
}

impl Preemption {
    pub fn parse(name: &str) -> CoreResult<Preemption> {
        match name {
            "recompute" => Ok(Preemption::Recompute),
            "swap" => Ok(Preemption::Swap),
            other => Err(CoreError::invalid(format!(
                "preemption must be \"recompute\" or \"swap\", got {other:?}"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preemption::Recompute => "recompute",
            Preemption::Swap => "swap",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub enable_chunked_prefill: bool,
    pub preemption: Preemption,
    /// Fraction of the blocks admission and swap-in leave free for running decodes.
    pub watermark: f64,
}

impl SchedulerConfig {
    pub fn validate(&self) -> CoreResult<()> {
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return Err(CoreError::invalid(
                "max_num_seqs and max_num_batched_tokens must be at least 1",
            ));
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return Err(CoreError::invalid(format!(
                "watermark must be in [0, 1), got {}",
                self.watermark
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Running,
    Swapped,
}

#[derive(Debug, Clone)]
struct Request {
    state: State,
    priority: u32,
    /// Arrival order; preempted requests get a key ahead of every arrival.
    queue_key: i64,
    /// When it was last admitted or resumed, to pick the newest as a preemption victim.
    admitted: u64,
    prompt_len: usize,
    /// Prompt ids, then the sampled ids (empty when the prompt was given as a count).
    token_ids: Vec<u32>,
    has_ids: bool,
    num_outputs: usize,
    max_new_tokens: usize,
    /// Tokens whose K/V is computed (or planned this step).
    num_computed: usize,
    /// A plan sampled its next token, not yet reported by `on_tokens`: it is not scheduled
    /// until then, wherever a preemption put it meanwhile.
    awaiting_token: bool,
    arrival_ns: u64,
}

impl Request {
    fn num_tokens(&self) -> usize {
        self.prompt_len + self.num_outputs
    }
}

/// The decisions of one step, and the inputs a paged-attention model runner feeds its
/// kernels (named as vLLM's model runner names them). Batch rows are the scheduled sequences,
/// prefills first; token arrays are flat over the rows' tokens, row by row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub prefill_seq_ids: Vec<u64>,
    pub prefill_tokens: Vec<i32>,
    pub decode_seq_ids: Vec<u64>,
    /// Sequences whose step ends with a sampled token (decodes and finished prefills).
    pub sample_seq_ids: Vec<u64>,
    pub preempted_seq_ids: Vec<u64>,
    /// Requests that ended (finished or aborted) since the previous plan.
    pub finished_seq_ids: Vec<u64>,
    /// Block moves, in the order they must be executed (before the model runs).
    pub moves: Vec<BlockMove>,
    /// Per batch row: tokens computed this step, and K/V length after it (`seq_lens`).
    pub query_lens: Vec<i32>,
    pub context_lens: Vec<i32>,
    /// `[rows + 1]`: where each row's tokens start in the flat token arrays.
    pub query_start_loc: Vec<i32>,
    /// Columns the rows' block tables need (the most blocks of any row); the table itself
    /// is written in place by [`ContinuousScheduler::write_block_tables`].
    pub block_table_width: usize,
    /// Per token: its id (prompt ids, then the last sampled token; -1 when the request was
    /// given as a token count), its position in its sequence, and its K/V slot.
    pub input_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i32>,
    /// Per sampling row (in `sample_seq_ids` order): the flat index of its last token.
    pub logits_indices: Vec<i32>,
    pub num_batched_tokens: usize,
}

impl StepPlan {
    /// Empties every field, keeping the buffers' capacity.
    pub fn clear(&mut self) {
        let StepPlan {
            prefill_seq_ids,
            prefill_tokens,
            decode_seq_ids,
            sample_seq_ids,
            preempted_seq_ids,
            finished_seq_ids,
            moves,
            query_lens,
            context_lens,
            query_start_loc,
            block_table_width,
            input_ids,
            positions,
            slot_mapping,
            logits_indices,
            num_batched_tokens,
        } = self;
        for ids in [
            prefill_seq_ids,
            decode_seq_ids,
            sample_seq_ids,
            preempted_seq_ids,
            finished_seq_ids,
        ] {
            ids.clear();
        }
        for cells in [
            prefill_tokens,
            query_lens,
            context_lens,
            query_start_loc,
            input_ids,
            positions,
            slot_mapping,
            logits_indices,
        ] {
            cells.clear();
        }
        moves.clear();
        *block_table_width = 0;
        *num_batched_tokens = 0;
    }
}

#[derive(Debug, Clone)]
pub struct ContinuousScheduler {
    config: SchedulerConfig,
    requests: HashMap<u64, Request>,
    waiting: BTreeSet<(u32, i64, u64)>,
    swapped: BTreeSet<(u32, i64, u64)>,
    running: Vec<u64>,
    next_arrival: i64,
    next_front: i64,
    next_admission: u64,
    num_preemptions: u64,
    /// Requests ended since the last plan (reported in the next one).
    finished_since_plan: Vec<u64>,
    /// Rows of the last plan, until it is known to have run (the next `step`/`on_tokens`).
    in_flight: Vec<u64>,
    /// Aborted requests with rows in flight: their blocks are freed once the plan ran, so
    /// the runner can still write every row, and no block it writes was handed out again.
    deferred_frees: Vec<u64>,
    scratch_slots: Vec<i32>,
    scratch_ids: Vec<u64>,
    /// Running sequences by (priority, admission), then id.
    scratch_order: Vec<((u32, u64), u64)>,
    block_tables: BlockTableWriter,
    scratch_scheduled: Vec<(u64, usize, bool)>,
}

impl ContinuousScheduler {
    pub fn new(config: SchedulerConfig, cache: &KvCache) -> CoreResult<Self> {
        config.validate()?;
        if config.preemption == Preemption::Swap && cache.num_host_blocks() == 0 {
            return Err(CoreError::invalid(
                "preemption=\"swap\" needs a KV cache with a host tier (num_host_blocks)",
            ));
        }
        Ok(ContinuousScheduler {
            config,
            requests: HashMap::new(),
            waiting: BTreeSet::new(),
            swapped: BTreeSet::new(),
            running: Vec::new(),
            next_arrival: 0,
            next_front: -1,
            next_admission: 0,
            num_preemptions: 0,
            finished_since_plan: Vec::new(),
            in_flight: Vec::new(),
            deferred_frees: Vec::new(),
            scratch_slots: Vec::new(),
            scratch_ids: Vec::new(),
            scratch_order: Vec::new(),
            block_tables: BlockTableWriter::new(),
            scratch_scheduled: Vec::new(),
        })
    }

    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// Validated first; a bad configuration changes nothing. Returns the previous one.
    pub fn set_config(
        &mut self,
        config: SchedulerConfig,
        cache: &KvCache,
    ) -> CoreResult<SchedulerConfig> {
        config.validate()?;
        if config.preemption == Preemption::Swap && cache.num_host_blocks() == 0 {
            return Err(CoreError::invalid("preemption=\"swap\" needs a host tier"));
        }
        Ok(std::mem::replace(&mut self.config, config))
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }

    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn contains(&self, seq_id: u64) -> bool {
        self.requests.contains_key(&seq_id)
    }

    /// (prompt length, sampled so far, max_new_tokens) of a request.
    pub fn progress(&self, seq_id: u64) -> CoreResult<(usize, usize, usize)> {
        let request = self
            .requests
            .get(&seq_id)
            .ok_or(CoreError::UnknownSequence(seq_id))?;
        Ok((
            request.prompt_len,
            request.num_outputs,
            request.max_new_tokens,
        ))
    }

    fn watermark_blocks(&self, cache: &KvCache) -> usize {
        (self.config.watermark * cache.num_blocks() as f64).ceil() as usize
    }

    /// Queues a request. Refuses one that could never fit the cache.
    #[allow(clippy::too_many_arguments)]
    pub fn add_request(
        &mut self,
        cache: &KvCache,
        seq_id: u64,
        prompt: Tokens<'_>,
        max_new_tokens: usize,
        priority: u32,
        arrival_ns: u64,
    ) -> CoreResult<()> {
        if self.requests.contains_key(&seq_id) || cache.contains(seq_id) {
            return Err(CoreError::DuplicateSequence(seq_id));
        }
        if prompt.is_empty() || max_new_tokens == 0 {
            return Err(CoreError::invalid(
                "the prompt and max_new_tokens must be at least 1",
            ));
        }
        let longest = prompt.len() + max_new_tokens;
        let room = (cache.num_blocks() - 1).saturating_sub(self.watermark_blocks(cache))
            * cache.block_size();
        if longest > room {
            return Err(CoreError::invalid(format!(
                "request {seq_id} may hold {longest} tokens; with the watermark the cache fits {room}"
            )));
        }
        if !self.config.enable_chunked_prefill && longest > self.config.max_num_batched_tokens {
            return Err(CoreError::invalid(format!(
                "request {seq_id} may need a {longest}-token prefill (after a preemption), more than \
                 max_num_batched_tokens={} without chunked prefill",
                self.config.max_num_batched_tokens
            )));
        }
        let token_ids = match prompt {
            Tokens::Ids(ids) => ids.to_vec(),
            Tokens::Count(_) => Vec::new(),
        };
        let queue_key = self.next_arrival;
        self.next_arrival += 1;
        self.requests.insert(
            seq_id,
            Request {
                state: State::Waiting,
                priority,
                queue_key,
                admitted: 0,
                prompt_len: prompt.len(),
                has_ids: matches!(prompt, Tokens::Ids(_)),
                token_ids,
                num_outputs: 0,
                max_new_tokens,
                num_computed: 0,
                awaiting_token: false,
                arrival_ns,
            },
        );
        self.waiting.insert((priority, queue_key, seq_id));
        Ok(())
    }

    /// Ends a request wherever it is, freeing its blocks — at once, or, if the last plan has
    /// a row of it, once that plan ran (the next `step` or `on_tokens`).
    pub fn abort(&mut self, cache: &mut KvCache, seq_id: u64) -> CoreResult<()> {
        let request = self
            .requests
            .remove(&seq_id)
            .ok_or(CoreError::UnknownSequence(seq_id))?;
        let key = (request.priority, request.queue_key, seq_id);
        match request.state {
            State::Waiting => {
                self.waiting.remove(&key);
            }
            State::Swapped => {
                self.swapped.remove(&key);
            }
            State::Running => self.running.retain(|&id| id != seq_id),
        }
        if self.in_flight.contains(&seq_id) {
            self.deferred_frees.push(seq_id);
        } else if cache.contains(seq_id) {
            cache.free_sequence(seq_id)?;
        }
        self.finished_since_plan.push(seq_id);
        Ok(())
    }

    /// The last plan ran (the contract says so by now): free what aborts deferred.
    fn plan_executed(&mut self, cache: &mut KvCache) -> CoreResult<()> {
        self.in_flight.clear();
        for seq_id in self.deferred_frees.drain(..) {
            if cache.contains(seq_id) {
                cache.free_sequence(seq_id)?;
            }
        }
        Ok(())
    }

    /// Records the sampled tokens of the sequences the last step planned to sample. A
    /// sequence that reached `max_new_tokens` (or sampled `eos_token_id`) finishes and its
    /// blocks are freed; the finished ids are appended to `finished`. All-or-nothing.
    pub fn on_tokens(
        &mut self,
        cache: &mut KvCache,
        seq_ids: &[u64],
        token_ids: &[u32],
        eos_token_id: Option<u32>,
        finished: &mut Vec<u64>,
    ) -> CoreResult<()> {
        if seq_ids.len() != token_ids.len() {
            return Err(CoreError::invalid(
                "seq_ids and token_ids must have the same length",
            ));
        }
        for &seq_id in seq_ids {
            let request = self
                .requests
                .get(&seq_id)
                .ok_or(CoreError::UnknownSequence(seq_id))?;
            if !request.awaiting_token {
                return Err(CoreError::invalid(format!(
                    "sequence {seq_id} has no token to sample now"
                )));
            }
        }
        self.scratch_ids.clear();
        self.scratch_ids.extend_from_slice(seq_ids);
        self.scratch_ids.sort_unstable();
        if let Some(pair) = self.scratch_ids.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(CoreError::invalid(format!(
                "sequence {} appears twice",
                pair[0]
            )));
        }
        self.plan_executed(cache)?;
        for (&seq_id, &token) in seq_ids.iter().zip(token_ids) {
            let Some(request) = self.requests.get_mut(&seq_id) else {
                continue;
            };
            request.num_outputs += 1;
            request.awaiting_token = false;
            if request.has_ids {
                request.token_ids.push(token);
            }
            if request.num_outputs >= request.max_new_tokens || Some(token) == eos_token_id {
                let key = (request.priority, request.queue_key, seq_id);
                self.requests.remove(&seq_id);
                self.running.retain(|&id| id != seq_id);
                self.waiting.remove(&key);
                self.swapped.remove(&key);
                if cache.contains(seq_id) {
                    cache.free_sequence(seq_id)?;
                }
                finished.push(seq_id);
                self.finished_since_plan.push(seq_id);
            }
        }
        Ok(())
    }

    /// Plans one step at time `now_ns` into `plan` (cleared first).
    pub fn step(
        &mut self,
        cache: &mut KvCache,
        now_ns: u64,
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        self.plan_executed(cache)?;
        plan.clear();
        // A lowered max_num_seqs takes effect now: the newest extra sequences make room.
        while self.running.len() > self.config.max_num_seqs {
            let victim = self.pick_victim(0);
            self.preempt(cache, victim, plan)?;
        }
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled = std::mem::take(&mut self.scratch_scheduled);
        scheduled.clear();

        // 1. Running sequences, highest priority and oldest first.
        let mut order = std::mem::take(&mut self.scratch_order);
        order.clear();
        order.extend(self.running.iter().map(|&id| {
            let key = self.requests.get(&id).map(|r| (r.priority, r.admitted));
            (key.unwrap_or_default(), id)
        }));
        order.sort_unstable();
        for &(_, seq_id) in &order {
            if budget == 0 {
                break;
            }
            let Some(request) = self.requests.get(&seq_id) else {
                continue;
            };
            if request.state != State::Running || request.awaiting_token {
                continue; // preempted this step, or waiting for its sampled token
            }
            let remaining = request.num_tokens() - request.num_computed;
            // Tokens that already have slots (a prompt, or everything a recompute brought
            // back) are prefilled, in chunks; only a sampled token without a slot is a decode.
            let prefill = request.num_computed < cache.seq_len(seq_id)?;
            if !prefill {
                // A decode: one more slot, which may need a block.
                // One token takes at most a new block and a copy-on-write one.
                while cache.num_free_blocks() < 2 {
                    let needed = cache.blocks_to_append(seq_id, 1)?;
                    if needed <= cache.num_free_blocks() {
                        break;
                    }
                    let victim = self.pick_victim(seq_id);
                    self.preempt(cache, victim, plan)?;
                    if victim == seq_id {
                        break;
                    }
                }
                let Some(request) = self
                    .requests
                    .get_mut(&seq_id)
                    .filter(|r| r.state == State::Running)
                else {
                    continue;
                };
                // The last sampled token's id joins the sequence's history with its slot.
                let last = request.num_tokens() - 1;
                let token_id = request.token_ids.get(last..).filter(|_| request.has_ids);
                cache.append_tokens(&[seq_id], 1, token_id, &mut self.scratch_slots)?;
                request.num_computed += 1;
                cache.mark_computed(seq_id, Some(request.num_computed))?;
                scheduled.push((seq_id, 1, false));
                budget -= 1;
            } else {
                self.schedule_prefill(cache, seq_id, remaining, &mut budget, &mut scheduled)?;
            }
        }

        self.scratch_order = order;

        // 2. Swapped-out sequences come back before anything new is admitted.
        if plan.preempted_seq_ids.is_empty() {
            while let Some(&(priority, key, seq_id)) = self.swapped.first() {
                let blocks = cache.block_table(seq_id)?.len();
                if self.running.len() >= self.config.max_num_seqs
                    || blocks + self.watermark_blocks(cache) > cache.num_free_blocks()
                {
                    break;
                }
                self.swapped.remove(&(priority, key, seq_id));
                cache.swap_in(&[seq_id])?;
                self.resume(seq_id, State::Running);
            }
        }

        // 3. Waiting requests, while nothing waits to resume.
        while plan.preempted_seq_ids.is_empty() && self.swapped.is_empty() && budget > 0 {
            // Requests are not admitted before they arrive.
            let requests = &self.requests;
            let Some(&(priority, key, seq_id)) = self.waiting.iter().find(|&&(_, _, id)| {
                requests
                    .get(&id)
                    .is_some_and(|r| r.arrival_ns <= now_ns && !r.awaiting_token)
            }) else {
                break;
            };
            if self.running.len() >= self.config.max_num_seqs {
                break;
            }
            let request = &self.requests[&seq_id];
            let total = request.num_tokens();
            let tokens = if request.has_ids {
                Tokens::Ids(&request.token_ids)
            } else {
                Tokens::Count(total)
            };
            let needed = cache.blocks_to_allocate(tokens, None)?;
            if needed + self.watermark_blocks(cache) > cache.num_free_blocks() {
                break;
            }
            let cached = cache.alloc_sequence(seq_id, tokens, None)?;
            self.waiting.remove(&(priority, key, seq_id));
            self.resume(seq_id, State::Running);
            let request = self
                .requests
                .get_mut(&seq_id)
                .ok_or(CoreError::UnknownSequence(seq_id))?;
            request.num_computed = cached;
            // Without chunking, a prompt larger than what is left of the budget waits, with its
            // blocks, for a later step.
            self.schedule_prefill(cache, seq_id, total - cached, &mut budget, &mut scheduled)?;
        }

        let result = self.build_plan(cache, &scheduled, plan);
        self.scratch_scheduled = scheduled;
        result
    }

    /// Plans the next chunk of a prefill with `remaining` tokens left, within `budget`.
    fn schedule_prefill(
        &mut self,
        cache: &mut KvCache,
        seq_id: u64,
        remaining: usize,
        budget: &mut usize,
        scheduled: &mut Vec<(u64, usize, bool)>,
    ) -> CoreResult<()> {
        let chunk = remaining.min(*budget);
        // Without chunked prefill a prompt waits for a step with room for all of it — unless
        // no step ever has (the budget was lowered after it was accepted): then it is chunked.
        let never_fits = remaining > self.config.max_num_batched_tokens;
        if chunk == 0 || (chunk < remaining && !self.config.enable_chunked_prefill && !never_fits) {
            return Ok(());
        }
        let request = self
            .requests
            .get_mut(&seq_id)
            .ok_or(CoreError::UnknownSequence(seq_id))?;
        request.num_computed += chunk;
        cache.mark_computed(seq_id, Some(request.num_computed))?;
        scheduled.push((seq_id, chunk, true));
        *budget -= chunk;
        Ok(())
    }

    fn resume(&mut self, seq_id: u64, state: State) {
        let admitted = self.next_admission;
        self.next_admission += 1;
        if let Some(request) = self.requests.get_mut(&seq_id) {
            request.state = state;
            request.admitted = admitted;
        }
        self.running.push(seq_id);
    }

    /// The newest, lowest-priority running sequence.
    fn pick_victim(&self, fallback: u64) -> u64 {
        self.running
            .iter()
            .copied()
            .max_by_key(|id| {
                self.requests
                    .get(id)
                    .map(|r| (r.priority, r.admitted))
                    .unwrap_or_default()
            })
            .unwrap_or(fallback)
    }

    fn preempt(&mut self, cache: &mut KvCache, seq_id: u64, plan: &mut StepPlan) -> CoreResult<()> {
        self.running.retain(|&id| id != seq_id);
        self.num_preemptions += 1;
        plan.preempted_seq_ids.push(seq_id);
        let Some(request) = self.requests.get_mut(&seq_id) else {
            return Ok(());
        };
        let blocks = cache.block_table(seq_id)?.len();
        let swap =
            self.config.preemption == Preemption::Swap && blocks <= cache.num_free_host_blocks();
        if swap {
            cache.swap_out(&[seq_id])?;
            request.state = State::Swapped;
            request.queue_key = self.next_front;
            self.swapped
                .insert((request.priority, request.queue_key, seq_id));
        } else {
            // Recompute: everything known so far becomes the prompt of a fresh prefill.
            cache.free_sequence(seq_id)?;
            request.num_computed = 0;
            request.state = State::Waiting;
            request.queue_key = self.next_front;
            self.waiting
                .insert((request.priority, request.queue_key, seq_id));
        }
        self.next_front -= 1;
        Ok(())
    }

    fn build_plan(
        &mut self,
        cache: &mut KvCache,
        scheduled: &[(u64, usize, bool)],
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        // Prefills first, then decodes, each in scheduling order.
        let rows = scheduled
            .iter()
            .filter(|row| row.2)
            .chain(scheduled.iter().filter(|row| !row.2));
        plan.query_start_loc.push(0);
        for &(seq_id, tokens, prefill) in rows {
            let request = self
                .requests
                .get(&seq_id)
                .ok_or(CoreError::UnknownSequence(seq_id))?;
            if prefill {
                plan.prefill_seq_ids.push(seq_id);
                plan.prefill_tokens.push(tokens as i32);
            } else {
                plan.decode_seq_ids.push(seq_id);
            }
            let end = request.num_computed;
            let start = end - tokens;
            plan.num_batched_tokens += tokens;
            if end == request.num_tokens() {
                plan.sample_seq_ids.push(seq_id);
                plan.logits_indices.push(plan.num_batched_tokens as i32 - 1);
            }
            plan.query_lens.push(tokens as i32);
            plan.context_lens.push(end as i32);
            plan.query_start_loc.push(plan.num_batched_tokens as i32);
            match request.has_ids {
                true => plan.input_ids.extend(
                    request.token_ids[start..end]
                        .iter()
                        .map(|&token| token as i32),
                ),
                false => plan.input_ids.resize(plan.num_batched_tokens, -1),
            }
            plan.positions.extend(start as i32..end as i32);
            let (blocks, _, _) = cache.row_view(seq_id)?;
            let block_size = cache.block_size();
            plan.slot_mapping.extend((start..end).map(|position| {
                (blocks[position / block_size] as usize * block_size + position % block_size) as i32
            }));
            plan.block_table_width = plan.block_table_width.max(blocks.len());
        }
        for seq_id in &plan.sample_seq_ids {
            if let Some(request) = self.requests.get_mut(seq_id) {
                request.awaiting_token = true;
            }
        }
        cache.take_moves(&mut plan.moves);
        plan.finished_seq_ids.append(&mut self.finished_since_plan);
        self.in_flight.extend_from_slice(&plan.prefill_seq_ids);
        self.in_flight.extend_from_slice(&plan.decode_seq_ids);
        Ok(())
    }

    /// Writes the block tables of `plan`'s rows into `cells` (row-major, `stride` columns,
    /// padded with the null block), updating in place what the previous call wrote there.
    /// `fresh`: `cells` is a new, zeroed buffer. Call it once the plan's moves have run.
    pub fn write_block_tables(
        &mut self,
        cache: &KvCache,
        plan: &StepPlan,
        cells: &mut [i32],
        stride: usize,
        fresh: bool,
    ) -> CoreResult<()> {
        if fresh {
            self.block_tables.reset();
        }
        let mut rows = std::mem::take(&mut self.scratch_ids);
        rows.clear();
        rows.extend_from_slice(&plan.prefill_seq_ids);
        rows.extend_from_slice(&plan.decode_seq_ids);
        let result = self.block_tables.write(cache, &rows, cells, stride);
        self.scratch_ids = rows;
        result
    }

    /// Whether the next step may decide block moves (and so needs a snapshot to roll back to
    /// if executing them fails): moves already pending, a swap-in, a swap preemption (some
    /// decode may find no free block), or a copy-on-write (only after a fork).
    pub fn step_may_move(&self, cache: &KvCache) -> bool {
        cache.num_pending_moves() > 0
            || !self.swapped.is_empty()
            || cache.has_forked()
            || (self.config.preemption == Preemption::Swap
                && cache.num_free_host_blocks() > 0
                && (cache.num_free_blocks() < self.running.len()
                    || self.running.len() > self.config.max_num_seqs))
    }

    /// Puts the scheduler and `cache` back to `snapshot` (taken before a step) after
    /// executing the step's `moves` failed with the first `attempted` possibly run. Requests
    /// whose bytes the partial execution destroyed end; their ids go to `aborted`.
    pub fn recover_from_failed_moves(
        &mut self,
        cache: &mut KvCache,
        snapshot: (ContinuousScheduler, KvCache),
        moves: &[BlockMove],
        attempted: usize,
        aborted: &mut Vec<u64>,
    ) {
        let (scheduler, cache_snapshot) = snapshot;
        *self = scheduler;
        let first = aborted.len();
        cache.recover_from_failed_moves(cache_snapshot, moves, attempted, aborted);
        for &seq_id in &aborted[first..] {
            if let Some(request) = self.requests.remove(&seq_id) {
                let key = (request.priority, request.queue_key, seq_id);
                self.waiting.remove(&key);
                self.swapped.remove(&key);
                self.running.retain(|&id| id != seq_id);
                self.finished_since_plan.push(seq_id);
            }
        }
    }

    /// Checks the scheduler's bookkeeping against the cache (for tests).
    pub fn check_invariants(&self, cache: &KvCache) -> Result<(), String> {
        for (&seq_id, request) in &self.requests {
            let key = (request.priority, request.queue_key, seq_id);
            let (in_waiting, in_swapped, in_running) = (
                self.waiting.contains(&key),
                self.swapped.contains(&key),
                self.running.contains(&seq_id),
            );
            let expected = match request.state {
                State::Waiting => (true, false, false),
                State::Swapped => (false, true, false),
                State::Running => (false, false, true),
            };
            if (in_waiting, in_swapped, in_running) != expected {
                return Err(format!(
                    "request {seq_id} is {:?} but queued as {:?}",
                    request.state,
                    (in_waiting, in_swapped, in_running)
                ));
            }
            let on_cache = cache.contains(seq_id);
            if on_cache != (request.state != State::Waiting) {
                return Err(format!(
                    "request {seq_id} ({:?}) on the cache: {on_cache}",
                    request.state
                ));
            }
            if request.state == State::Running {
                let slots = cache.seq_len(seq_id).map_err(|error| error.to_string())?;
                if slots < request.num_computed || slots > request.num_tokens() {
                    return Err(format!(
                        "request {seq_id}: {slots} slots for {} computed of {} tokens",
                        request.num_computed,
                        request.num_tokens()
                    ));
                }
            }
            if request.num_computed > request.num_tokens()
                || request.num_outputs >= request.max_new_tokens
            {
                return Err(format!("request {seq_id} overran: {request:?}"));
            }
        }
        if self.running.len() > self.config.max_num_seqs {
            return Err(format!(
                "{} running > max_num_seqs {}",
                self.running.len(),
                self.config.max_num_seqs
            ));
        }
        if self.waiting.len() + self.swapped.len() + self.running.len() != self.requests.len() {
            return Err("queues and requests disagree".into());
        }
        cache.check_invariants()
    }

    /// Arrival time of a request.
    pub fn arrival_ns(&self, seq_id: u64) -> CoreResult<u64> {
        Ok(self
            .requests
            .get(&seq_id)
            .ok_or(CoreError::UnknownSequence(seq_id))?
            .arrival_ns)
    }
}
