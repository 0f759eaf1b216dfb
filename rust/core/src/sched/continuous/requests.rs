//! Requests arrive, sample tokens, finish or are aborted.

use super::{ContinuousScheduler, QueueKey, SchedulerConfig};
use crate::alloc::{BlockHash, EvictionPolicy, DEFAULT_PRIORITY};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::{KvCache, RetentionConfig, Tokens};
use crate::undo::Stamp;

/// Whether a request of `longest` tokens (prompt and every new token) and `num_samples`
/// sequences could ever be scheduled under `config`: refused otherwise, as it would wait
/// forever.
pub(super) fn check_request(
    config: &SchedulerConfig,
    cache: &KvCache,
    seq_id: u64,
    (prompt_len, max_new_tokens): (usize, usize),
    num_samples: usize,
) -> CoreResult<()> {
    let longest = prompt_len + max_new_tokens;
    let room = config.room(cache);
    if longest > room {
        return Err(refused(
            seq_id,
            format!(
                "may hold {longest} tokens; with watermark={} the cache fits {room}",
                config.watermark
            ),
        ));
    }
    // At its first token it forks, each fork's recurrent states in blocks of its own beside
    // the prompt's: a cache that cannot hold them all at once never runs it.
    let forks = num_samples.saturating_sub(1) * cache.num_state_blocks();
    if forks > 0 {
        let usable = (cache.num_blocks() - 1).saturating_sub(config.watermark_blocks(cache));
        let beside = cache.tokens_in_blocks(usable.saturating_sub(forks));
        if prompt_len + 1 > beside {
            return Err(refused(
                seq_id,
                format!(
                    "forks {} samples at its first token, whose recurrent states take {forks} \
                     more blocks: beside them the cache fits {beside} tokens, not its \
                     {prompt_len}-token prompt",
                    num_samples - 1
                ),
            ));
        }
    }
    if num_samples > config.max_num_seqs {
        return Err(refused(
            seq_id,
            format!(
                "runs {num_samples} samples side by side, more than max_num_seqs={}",
                config.max_num_seqs
            ),
        ));
    }
    Ok(())
}

/// How much a request's scheduling priority lowers the retention of its tokens.
fn retention_lowering(priority: u32) -> u8 {
    u8::try_from(priority).unwrap_or(u8::MAX)
}

/// What a request of scheduling `priority` that asked for no retention keeps.
fn lowered_retention(priority: u32, prompt_len: usize) -> RetentionConfig {
    RetentionConfig {
        decode_from: prompt_len,
        default_priority: DEFAULT_PRIORITY.saturating_sub(retention_lowering(priority)),
        ..RetentionConfig::default()
    }
}

fn refused(seq_id: u64, reason: String) -> CoreError {
    CoreError::RequestRefused { seq_id, reason }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Waiting,
    Running,
    Swapped,
    /// Admitted, its prefix being loaded from a lower tier (see `loads`).
    Loading,
}

#[derive(Debug, Clone)]
pub(super) struct Request {
    pub state: State,
    pub priority: u32,
    /// Arrival order; preempted requests get a key ahead of every arrival.
    pub queue_key: i64,
    /// When it was last admitted or resumed, to pick the newest as a preemption victim.
    pub admitted: u64,
    pub prompt_len: usize,
    /// Prompt ids, then the sampled ids (empty when the prompt was given as a count).
    pub token_ids: Vec<u32>,
    pub has_ids: bool,
    pub num_outputs: usize,
    pub max_new_tokens: usize,
    /// Tokens whose K/V is computed (or planned this step).
    pub num_computed: usize,
    /// A plan sampled its next token, not yet reported by `on_tokens`: it is not scheduled
    /// until then, wherever a preemption put it meanwhile.
    pub awaiting_token: bool,
    /// Not admitted before this time.
    pub arrival_ns: u64,
    /// Prefix-cache hashes of the leading full blocks of `token_ids`, kept so that a request
    /// waiting for room is not hashed again at every step's admission check.
    pub block_hashes: Vec<BlockHash>,
    /// Samples still to be forked from it (`n - 1` until its first token): they hold seats
    /// under `max_num_seqs` from its admission on, so the forks never overrun the limit.
    pub samples_to_fork: usize,
    /// Leading full blocks the lower tiers hold (`offer_external_prefix`).
    pub external_blocks: usize,
    /// While loading: how many blocks past `num_computed` the load brings.
    pub loading_blocks: usize,
    /// What it asks the prefix cache to keep (`set_retention`), given to its sequence at
    /// every admission; boxed, as few requests have one and the step walks them all.
    pub retention: Option<Box<RetentionConfig>>,
    /// The transaction that last changed it (see `request_table`).
    pub changed_in: Stamp,
}

impl Request {
    pub fn num_tokens(&self) -> usize {
        self.prompt_len + self.num_outputs
    }

    pub fn queue_key(&self, seq_id: u64) -> QueueKey {
        (self.priority, self.queue_key, seq_id)
    }

    /// What the cache is given when the request is (re)admitted: everything known so far.
    pub fn tokens(&self) -> Tokens<'_> {
        match self.has_ids {
            true => Tokens::Ids(&self.token_ids),
            false => Tokens::Count(self.num_tokens()),
        }
    }

    /// Hashes the full blocks of `token_ids` not hashed yet (none when the ids are unknown).
    pub fn hash_blocks(&mut self, block_size: usize) {
        if !self.has_ids {
            return;
        }
        let full = self.token_ids.len() / block_size;
        let mut parent = self.block_hashes.last().copied();
        for index in self.block_hashes.len()..full {
            let chunk = &self.token_ids[index * block_size..(index + 1) * block_size];
            let hash = parent.unwrap_or(BlockHash::root(None)).chain(chunk);
            self.block_hashes.push(hash);
            parent = Some(hash);
        }
    }
}

impl ContinuousScheduler {
    /// Queues a request of `num_samples` sequences (forked from it at its first token).
    /// Refuses one that could never fit the cache or the batch. Under the priority policy a
    /// scheduling `priority` lowers its blocks' retention (see `retain_admitted`): the cache
    /// is readied for that here, so that no step allocates for it.
    #[allow(clippy::too_many_arguments)]
    pub fn add_request(
        &mut self,
        cache: &mut KvCache,
        seq_id: u64,
        prompt: Tokens<'_>,
        max_new_tokens: usize,
        num_samples: usize,
        priority: u32,
        arrival_ns: u64,
    ) -> CoreResult<()> {
        if self.requests.contains_key(&seq_id) || cache.contains(seq_id) {
            return Err(CoreError::DuplicateSequence(seq_id));
        }
        ensure!(
            !prompt.is_empty() && max_new_tokens > 0 && num_samples > 0,
            "the prompt, max_new_tokens and num_samples must be at least 1"
        );
        let longest = prompt.len() + max_new_tokens;
        let lengths = (prompt.len(), max_new_tokens);
        check_request(&self.config, cache, seq_id, lengths, num_samples)?;
        if !self.config.enable_chunked_prefill && longest > self.config.max_num_batched_tokens {
            return Err(refused(
                seq_id,
                format!(
                    "may need a {longest}-token prefill (after a preemption), more than \
                     max_num_batched_tokens={} without chunked prefill",
                    self.config.max_num_batched_tokens
                ),
            ));
        }
        if cache.eviction_policy() == EvictionPolicy::Priority && retention_lowering(priority) > 0 {
            cache.prepare_retention(&lowered_retention(priority, prompt.len()))?;
        }
        let token_ids = match prompt {
            Tokens::Ids(ids) => ids.to_vec(),
            Tokens::Count(_) => Vec::new(),
        };
        let queue_key = self.next_arrival;
        self.next_arrival += 1;
        let request = Request {
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
            block_hashes: Vec::new(),
            samples_to_fork: num_samples - 1,
            external_blocks: 0,
            loading_blocks: 0,
            retention: None,
            changed_in: Stamp::default(),
        };
        self.unforked_samples += request.samples_to_fork;
        self.waiting.insert(request.queue_key(seq_id));
        self.requests.insert(seq_id, request);
        Ok(())
    }

    /// Sets what request `seq_id` asks the prefix cache to keep (see `RetentionConfig`);
    /// tokens from its prompt's end on are its decode tokens. Its sequence takes it (with its
    /// scheduling priority, as `retain_admitted` says) at every admission, and at once if
    /// admitted already.
    pub fn set_retention(
        &mut self,
        cache: &mut KvCache,
        seq_id: u64,
        mut config: RetentionConfig,
    ) -> CoreResult<()> {
        cache.prepare_retention(&config)?;
        let request = self.request_mut(seq_id)?;
        let admitted = cache.contains(seq_id) && request.state != State::Waiting;
        // Kept as every admission gives it, so that an admission copies nothing.
        config.decode_from = request.prompt_len;
        config.default_priority = config
            .default_priority
            .saturating_sub(retention_lowering(request.priority));
        request.retention = Some(Box::new(config));
        if admitted {
            self.retain_admitted(cache, seq_id)?;
        }
        Ok(())
    }

    /// Gives the sequence of just-admitted request `seq_id` its retention: its config, and
    /// its scheduling priority `p` (lower first) lowering its other tokens' priority by `p`.
    pub(super) fn retain_admitted(&self, cache: &mut KvCache, seq_id: u64) -> CoreResult<()> {
        if cache.eviction_policy() != EvictionPolicy::Priority {
            return Ok(());
        }
        let request = self.request(seq_id)?;
        match (
            request.retention.as_deref(),
            retention_lowering(request.priority),
        ) {
            (Some(config), _) => cache.set_retention(seq_id, config),
            (None, 0) => Ok(()),
            (None, _) => cache.set_retention(
                seq_id,
                &lowered_retention(request.priority, request.prompt_len),
            ),
        }
    }

    /// Ends a request wherever it is, freeing its blocks — at once, or, if the last plan has
    /// a row of it, once that plan ran (the next `step` or `on_tokens`).
    pub fn abort(&mut self, cache: &mut KvCache, seq_id: u64) -> CoreResult<()> {
        let request = self
            .forget(seq_id)
            .ok_or_else(|| CoreError::unknown_sequence(seq_id))?;
        if request.state == State::Loading {
            // A load is writing its blocks: they are freed once it is reported.
            self.abandoned_loads.push(seq_id);
        } else if self.in_flight.contains(&seq_id) {
            self.deferred_frees.push(seq_id);
        } else if cache.contains(seq_id) {
            cache.free_sequence(seq_id)?;
        }
        self.finished_since_plan.push(seq_id);
        Ok(())
    }

    /// Parallel sampling: between the step that sampled `parent` and its `on_tokens`, makes
    /// `child` a copy of it that shares every block copy-on-write and awaits its own token
    /// from the same logits — a prompt is prefilled once for `n` samples (vLLM v0's fork of
    /// a sequence group). The child runs with the parent's priority and limits; beyond
    /// `max_num_seqs`, the next step preempts the newest. A fork beyond the request's
    /// samples (`num_samples` at `add_request`) had no blocks kept for its recurrent states:
    /// `OutOfBlocks` when only the blocks kept for other requests' forks are left.
    pub fn fork(&mut self, cache: &mut KvCache, parent: u64, child: u64) -> CoreResult<()> {
        if self.requests.contains_key(&child) || cache.contains(child) {
            return Err(CoreError::DuplicateSequence(child));
        }
        let request = self.request(parent)?;
        ensure!(
            request.state == State::Running && request.awaiting_token,
            "sequence {parent} can be forked only after a step sampled it and before its \
             on_tokens"
        );
        let planned = request.samples_to_fork > 0;
        // A fork beyond the request's samples was kept no blocks: it may not take those kept
        // for the others' forks (see `fork_reserve`).
        let needed = cache.num_state_blocks();
        let available = self.free_blocks(cache);
        if !planned && needed > available {
            return Err(CoreError::OutOfBlocks { needed, available });
        }
        let mut copy = request.clone();
        copy.samples_to_fork = 0;
        cache.fork(parent, child)?;
        self.running.push(child);
        self.requests.insert(child, copy);
        if let Some(parent) = self.requests.get_mut(&parent).filter(|_| planned) {
            parent.samples_to_fork -= 1;
            self.unforked_samples -= 1;
            self.fork_reserve = self.fork_reserve.saturating_sub(needed);
        }
        self.forked_since_step += 1;
        Ok(())
    }

    /// Removes a request from the books and from whichever queue holds it.
    pub(super) fn forget(&mut self, seq_id: u64) -> Option<Request> {
        let request = self.requests.remove(&seq_id)?;
        self.unforked_samples -= request.samples_to_fork;
        let key = request.queue_key(seq_id);
        match request.state {
            State::Waiting => self.waiting.remove(&key),
            State::Swapped => self.swapped.remove(&key),
            State::Running => {
                self.running.retain(|&id| id != seq_id);
                true
            }
            State::Loading => {
                self.loading.retain(|&id| id != seq_id);
                true
            }
        };
        Some(request)
    }

    /// The last plan ran (the contract says so by now): free what aborts deferred.
    pub(super) fn plan_executed(&mut self, cache: &mut KvCache) -> CoreResult<()> {
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
        ensure!(
            seq_ids.len() == token_ids.len(),
            "seq_ids and token_ids must have the same length"
        );
        for &seq_id in seq_ids {
            ensure!(
                self.request(seq_id)?.awaiting_token,
                "sequence {seq_id} has no token to sample now"
            );
        }
        self.scratch_ids.clear();
        self.scratch_ids.extend_from_slice(seq_ids);
        self.scratch_ids.sort_unstable();
        if let Some(pair) = self.scratch_ids.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(invalid!("sequence {} appears twice", pair[0]));
        }
        self.plan_executed(cache)?;
        for (&seq_id, &token) in seq_ids.iter().zip(token_ids) {
            let Some(request) = self.requests.get_mut(&seq_id) else {
                continue;
            };
            request.num_outputs += 1;
            request.awaiting_token = false;
            // Whatever was not forked by now never will be.
            self.unforked_samples -= std::mem::take(&mut request.samples_to_fork);
            if request.has_ids {
                request.token_ids.push(token);
            }
            if request.num_outputs >= request.max_new_tokens || Some(token) == eos_token_id {
                self.forget(seq_id);
                if cache.contains(seq_id) {
                    cache.free_sequence(seq_id)?;
                }
                finished.push(seq_id);
                self.finished_since_plan.push(seq_id);
            }
        }
        Ok(())
    }
}
