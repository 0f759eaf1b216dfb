//! One step: the three phases (running, swapped, waiting) and the plan they produce.

use super::requests::State;
use super::{ContinuousScheduler, Preemption, StepPlan};
use crate::error::CoreResult;
use crate::kv_cache::KvCache;

/// A batch row decided this step: `num_tokens` tokens of `seq_id`, a prefill chunk or a
/// decode.
#[derive(Debug, Clone, Copy)]
pub(super) struct ScheduledRow {
    seq_id: u64,
    num_tokens: usize,
    prefill: bool,
}

impl ContinuousScheduler {
    /// Plans one step at time `now_ns` into `plan` (cleared first), once `check_cache`
    /// passed: every lookup below then finds what it looks for (see `transaction`).
    pub(super) fn plan_step(
        &mut self,
        cache: &mut KvCache,
        now_ns: u64,
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        self.plan_executed(cache)?;
        plan.clear();
        // A lowered max_num_seqs (or forks past it) takes effect now: the newest extra
        // sequences make room. Loading requests hold seats too, but are never preempted.
        while !self.running.is_empty()
            && self.running.len() + self.loading.len() > self.config.max_num_seqs
        {
            let victim = self.pick_victim(0);
            self.preempt(cache, victim, plan)?;
        }
        self.forked_since_step = 0;
        self.fork_reserve = self.blocks_for_forks(cache);
        self.decode_slots.clear();
        self.save_checkpoints(cache)?;
        let mut budget = self.config.max_num_batched_tokens;
        let mut rows = std::mem::take(&mut self.scratch_scheduled);
        rows.clear();
        let result = self.schedule(cache, now_ns, &mut budget, &mut rows, plan);
        let result = result.and_then(|()| self.build_plan(cache, &rows, plan));
        self.scratch_scheduled = rows;
        result
    }

    fn schedule(
        &mut self,
        cache: &mut KvCache,
        now_ns: u64,
        budget: &mut usize,
        rows: &mut Vec<ScheduledRow>,
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        self.schedule_running(cache, budget, rows, plan)?;
        // Nothing new starts while anything waits to resume, so none starves.
        if plan.preempted_seq_ids.is_empty() {
            self.swap_in_swapped(cache)?;
            if self.swapped.is_empty() {
                self.admit_waiting(cache, now_ns, budget, rows, plan)?;
            }
        }
        Ok(())
    }

    /// Phase 1: running sequences, highest priority and oldest first.
    fn schedule_running(
        &mut self,
        cache: &mut KvCache,
        budget: &mut usize,
        rows: &mut Vec<ScheduledRow>,
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        let mut order = std::mem::take(&mut self.scratch_order);
        order.clear();
        order.extend(self.running.iter().map(|&id| {
            let key = self.requests.get(&id).map(|r| (r.priority, r.admitted));
            (key.unwrap_or_default(), id)
        }));
        order.sort_unstable();
        let mut result = Ok(());
        for &(_, seq_id) in &order {
            if *budget == 0 {
                break;
            }
            result = self.schedule_one_running(cache, seq_id, budget, rows, plan);
            if result.is_err() {
                break;
            }
        }
        self.scratch_order = order;
        result
    }

    fn schedule_one_running(
        &mut self,
        cache: &mut KvCache,
        seq_id: u64,
        budget: &mut usize,
        rows: &mut Vec<ScheduledRow>,
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        let Some(request) = self.requests.get(&seq_id) else {
            return Ok(());
        };
        if request.state != State::Running || request.awaiting_token {
            return Ok(()); // preempted this step, or waiting for its sampled token
        }
        let remaining = request.num_tokens() - request.num_computed;
        // Tokens that already have slots (a prompt, or everything a recompute brought back)
        // are prefilled, in chunks; only a sampled token without a slot is a decode.
        if request.num_computed < cache.seq_len(seq_id)? {
            return self.schedule_prefill(cache, seq_id, remaining, budget, rows, Some(plan));
        }
        // A decode: one more slot, which may need a block and a copy-on-write one in each
        // group: make room by preempting the newest, lowest-priority sequences (possibly
        // this one).
        while self.free_blocks(cache) < 2 * cache.num_groups() {
            if cache.blocks_to_append(seq_id, 1)? <= self.free_blocks(cache) {
                break;
            }
            let victim = self.pick_victim(seq_id);
            self.preempt(cache, victim, plan)?;
            if victim == seq_id {
                return Ok(());
            }
        }
        let Some(request) = self.requests.get_mut(&seq_id) else {
            return Ok(());
        };
        // The last sampled token's id joins the sequence's history with its slot.
        let last = request.num_tokens() - 1;
        let token_id = request.token_ids.get(last..).filter(|_| request.has_ids);
        cache.append_tokens(&[seq_id], 1, token_id, &mut self.scratch_slots)?;
        request.num_computed += 1;
        cache.mark_computed(seq_id, Some(request.num_computed))?;
        self.decode_slots.extend_from_slice(&self.scratch_slots);
        rows.push(ScheduledRow {
            seq_id,
            num_tokens: 1,
            prefill: false,
        });
        *budget -= 1;
        Ok(())
    }

    /// Phase 2: swapped-out sequences come back (oldest preemption first) while blocks beyond
    /// the watermark and `max_num_seqs` allow.
    fn swap_in_swapped(&mut self, cache: &mut KvCache) -> CoreResult<()> {
        let mut seats = self.seats_taken();
        while let Some(&key) = self.swapped.first() {
            let seq_id = key.2;
            let blocks = cache.num_held_blocks(seq_id)?;
            let request = self.request(seq_id)?;
            let (wanted, forks) = (
                1 + request.samples_to_fork,
                Self::fork_blocks(request, cache),
            );
            if seats + wanted > self.config.max_num_seqs
                || blocks + forks + self.watermark_blocks(cache) > self.free_blocks(cache)
            {
                break;
            }
            cache.swap_in(&[seq_id])?;
            self.swapped.remove(&key);
            self.resume(seq_id, State::Running);
            seats += wanted;
            self.fork_reserve += forks;
        }
        Ok(())
    }

    /// Seats under `max_num_seqs`: the running sequences and the samples they will fork.
    pub(super) fn seats_taken(&self) -> usize {
        let seated = self.running.len() + self.loading.len();
        if self.unforked_samples == 0 {
            return seated;
        }
        let forks: usize = self
            .running
            .iter()
            .chain(&self.loading)
            .filter_map(|id| self.requests.get(id))
            .map(|request| request.samples_to_fork)
            .sum();
        seated + forks
    }

    /// Phase 3: waiting requests that have arrived, by priority then arrival, while their
    /// whole prompt's blocks (beyond the watermark) are free; prefix hits count as computed.
    fn admit_waiting(
        &mut self,
        cache: &mut KvCache,
        now_ns: u64,
        budget: &mut usize,
        rows: &mut Vec<ScheduledRow>,
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        let mut seats = self.seats_taken();
        while *budget > 0 && seats < self.config.max_num_seqs {
            let requests = &self.requests;
            let Some(&key) = self.waiting.iter().find(|&&(_, _, id)| {
                requests
                    .get(&id)
                    .is_some_and(|r| r.arrival_ns <= now_ns && !r.awaiting_token)
            }) else {
                break;
            };
            let seq_id = key.2;
            let watermark = self.watermark_blocks(cache);
            let free = self.free_blocks(cache);
            let max_num_seqs = self.config.max_num_seqs;
            let request = self.request_mut(seq_id)?;
            // A request waits for seats for all its samples (vLLM v0 counts a sequence
            // group's most running sequences the same way).
            let wanted = 1 + request.samples_to_fork;
            if seats + wanted > max_num_seqs {
                break;
            }
            let forks = Self::fork_blocks(request, cache);
            let total = request.num_tokens();
            // Hashed once while it waits, not at every step's check.
            request.hash_blocks(cache.block_size());
            let (tokens, hashes) = (request.tokens(), &request.block_hashes);
            // Windowed groups take a prompt's blocks chunk by chunk (`schedule_prefill`).
            let needed = cache.blocks_to_admit_hashed(tokens, hashes)?;
            if needed + forks + watermark > free {
                break;
            }
            let cached = cache.admit_sequence_hashed(seq_id, tokens, hashes)?;
            self.retain_admitted(cache, seq_id)?;
            self.waiting.remove(&key);
            seats += wanted;
            self.fork_reserve += forks;
            self.request_mut(seq_id)?.num_computed = cached;
            if self.start_load(cache, seq_id, cached, &mut plan.loads)? {
                continue; // it runs once its loads are reported
            }
            self.resume(seq_id, State::Running);
            // Without chunking, a prompt larger than what is left of the budget waits, with
            // its blocks, for a later step.
            self.schedule_prefill(cache, seq_id, total - cached, budget, rows, None)?;
        }
        Ok(())
    }

    /// Plans the next chunk of a prefill with `remaining` tokens left, within `budget` and
    /// the blocks its windowed groups need; a running prefill (`plan` given) preempts newer
    /// sequences for them, a newly admitted one waits.
    fn schedule_prefill(
        &mut self,
        cache: &mut KvCache,
        seq_id: u64,
        remaining: usize,
        budget: &mut usize,
        rows: &mut Vec<ScheduledRow>,
        mut plan: Option<&mut StepPlan>,
    ) -> CoreResult<()> {
        let mut chunk = remaining.min(*budget);
        // Without chunked prefill a prompt waits for a step with room for all of it — unless
        // no step ever has (the budget was lowered after it was accepted): then it is chunked.
        let never_fits = remaining > self.config.max_num_batched_tokens;
        let may_split = self.config.enable_chunked_prefill || never_fits;
        if chunk == 0 || (chunk < remaining && !may_split) {
            return Ok(());
        }
        let request = self.request(seq_id)?;
        let start = request.num_computed;
        // A chunk that passes where a checkpoint of recurrent states is kept stops there, so
        // the next step finds the states to keep (vLLM's `align`): a hybrid model's prompt
        // takes a step more, and the next one sharing it resumes there. Only with chunked
        // prefill: without it, a prompt runs whole (and keeps fewer checkpoints).
        let stride = cache.checkpoint_stride();
        if stride > 0 && request.has_ids && may_split {
            // Where the cached K/V it shares ends comes first (a checkpoint there serves the
            // next prompt that shares it), then its last block boundary, then the stride.
            let end = start + chunk;
            let inside = |at: usize| at > start && at < end;
            let (reach, last) = (cache.kv_reach(seq_id)?, cache.prompt_checkpoint(seq_id)?);
            let boundary = match (inside(reach), inside(last)) {
                (true, _) => reach,
                (false, true) => last,
                (false, false) => (end - 1) / stride * stride,
            };
            if boundary > start {
                chunk = boundary - start;
            }
        }
        let block_size = cache.block_size();
        while cache.blocks_to_compute(seq_id, start + chunk)? > self.free_blocks(cache) {
            // A shorter chunk (down to a block boundary) may fit; else make room.
            let shorter = ((start + chunk - 1) / block_size * block_size).saturating_sub(start);
            if may_split && shorter > 0 {
                chunk = shorter;
                continue;
            }
            let Some(plan) = plan.as_deref_mut() else {
                return Ok(());
            };
            let victim = self.pick_victim(seq_id);
            self.preempt(cache, victim, plan)?;
            if victim == seq_id {
                return Ok(());
            }
        }
        let request = self.request_mut(seq_id)?;
        request.num_computed += chunk;
        cache.mark_computed(seq_id, Some(request.num_computed))?;
        rows.push(ScheduledRow {
            seq_id,
            num_tokens: chunk,
            prefill: true,
        });
        *budget -= chunk;
        Ok(())
    }

    /// Keeps a checkpoint of every running sequence's recurrent states whose computed tokens
    /// (all computed by now: the last plan ran) end where one is kept, before this step plans
    /// tokens that change them. With nothing pending before them, the step's first
    /// `saved_moves` moves are theirs.
    fn save_checkpoints(&mut self, cache: &mut KvCache) -> CoreResult<()> {
        let pending = cache.num_pending_moves();
        self.saved_moves = 0;
        if cache.checkpoint_stride() == 0 {
            return Ok(());
        }
        for &seq_id in &self.running {
            cache.checkpoint_state(seq_id)?;
        }
        // With a host prefix cache, what the saves evict is demoted by moves of their own.
        if pending == 0 && !cache.host_prefix_cache() {
            self.saved_moves = cache.num_pending_moves();
        }
        Ok(())
    }

    pub(super) fn resume(&mut self, seq_id: u64, state: State) {
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

    /// Swaps the sequence out if the host tier has room (with `Preemption::Swap`), else
    /// frees its blocks to recompute it later; either way it resumes before new arrivals.
    fn preempt(&mut self, cache: &mut KvCache, seq_id: u64, plan: &mut StepPlan) -> CoreResult<()> {
        self.running.retain(|&id| id != seq_id);
        self.num_preemptions += 1;
        plan.preempted_seq_ids.push(seq_id);
        // Running no more, it forks nothing until it is back.
        if let Some(request) = self.requests.get(&seq_id) {
            let forks = Self::fork_blocks(request, cache);
            self.fork_reserve = self.fork_reserve.saturating_sub(forks);
        }
        let Some(request) = self.requests.get_mut(&seq_id) else {
            return Ok(());
        };
        let blocks = cache.num_held_blocks(seq_id)?;
        let swap =
            self.config.preemption == Preemption::Swap && blocks <= cache.num_free_host_blocks();
        request.queue_key = self.next_front;
        self.next_front -= 1;
        if swap {
            cache.swap_out(&[seq_id])?;
            request.state = State::Swapped;
            self.swapped.insert(request.queue_key(seq_id));
        } else {
            // Recompute: everything known so far becomes the prompt of a fresh prefill.
            cache.free_sequence(seq_id)?;
            request.num_computed = 0;
            request.state = State::Waiting;
            self.waiting.insert(request.queue_key(seq_id));
        }
        Ok(())
    }

    /// Turns the scheduled rows into the plan: prefills first, then decodes, each in
    /// scheduling order.
    fn build_plan(
        &mut self,
        cache: &mut KvCache,
        rows: &[ScheduledRow],
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        let prefills = rows.iter().filter(|row| row.prefill);
        let decodes = rows.iter().filter(|row| !row.prefill);
        plan.query_start_loc.push(0);
        for row in prefills.clone().chain(decodes.clone()) {
            self.add_row(cache, row, plan)?;
        }
        // Other groups' slots follow group 0's, group by group: `[groups, tokens]`.
        plan.num_groups = cache.num_groups();
        let tokens = plan.num_batched_tokens;
        if plan.num_groups > 1 {
            plan.slot_mapping.resize(tokens * plan.num_groups, 0);
            let block_size = cache.block_size();
            for (row, &first) in prefills.zip(&plan.query_start_loc) {
                let end = self.request(row.seq_id)?.num_computed;
                for (group, view) in cache.group_rows(row.seq_id)?.enumerate().skip(1) {
                    let out = &mut plan.slot_mapping[group * tokens + first as usize..];
                    for (cell, position) in out.iter_mut().zip(end - row.num_tokens..end) {
                        let block = view.blocks[position / block_size] as usize;
                        *cell = (block * block_size + position % block_size) as i32;
                    }
                }
            }
            // A decode's slots were known when its token was appended (nothing scheduled
            // after it in the step replaces a block of another sequence).
            let first_decode = tokens - decodes.count();
            for (decode, slots) in self.decode_slots.chunks_exact(plan.num_groups).enumerate() {
                let token = first_decode + decode;
                debug_assert_eq!(slots[0], plan.slot_mapping[token]);
                for (group, &slot) in slots.iter().enumerate().skip(1) {
                    plan.slot_mapping[group * tokens + token] = slot;
                }
            }
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

    fn add_row(&self, cache: &KvCache, row: &ScheduledRow, plan: &mut StepPlan) -> CoreResult<()> {
        let ScheduledRow {
            seq_id,
            num_tokens,
            prefill,
        } = *row;
        let request = self.request(seq_id)?;
        if prefill {
            plan.prefill_seq_ids.push(seq_id);
            plan.prefill_tokens.push(num_tokens as i32);
        } else {
            plan.decode_seq_ids.push(seq_id);
        }
        let end = request.num_computed;
        let start = end - num_tokens;
        plan.num_batched_tokens += num_tokens;
        if end == request.num_tokens() {
            plan.sample_seq_ids.push(seq_id);
            plan.logits_indices.push(plan.num_batched_tokens as i32 - 1);
        }
        plan.query_lens.push(num_tokens as i32);
        plan.context_lens.push(end as i32);
        plan.query_start_loc.push(plan.num_batched_tokens as i32);
        match request.has_ids {
            true => plan
                .input_ids
                .extend(request.token_ids[start..end].iter().map(|&id| id as i32)),
            false => plan.input_ids.resize(plan.num_batched_tokens, -1),
        }
        plan.positions.extend(start as i32..end as i32);
        let (blocks, _, _) = cache.row_view(seq_id, 0)?;
        let block_size = cache.block_size();
        plan.slot_mapping.extend((start..end).map(|position| {
            (blocks[position / block_size] as usize * block_size + position % block_size) as i32
        }));
        plan.block_table_width = plan.block_table_width.max(blocks.len());
        Ok(())
    }
}
