//! What a step relies on: the cache agreeing with the scheduler (checked before a step
//! changes anything), and the invariants (for tests).

use super::requests::State;
use super::ContinuousScheduler;
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::KvCache;

impl ContinuousScheduler {
    /// Checks that `cache` holds what this scheduler put there: every running request on the
    /// device with its computed tokens, every swapped one on the host, and none of the
    /// waiting requests a step at `now_ns` may admit. Everything a step looks up in the cache
    /// is checked here, before it changes anything, so a sequence freed (or allocated) behind
    /// the scheduler's back fails the step with nothing changed instead of half-way through
    /// it. One lookup per running or swapped request, and per free seat: a long queue costs
    /// nothing.
    pub fn check_cache(&self, cache: &KvCache, now_ns: u64) -> CoreResult<()> {
        for &seq_id in &self.running {
            let (num_tokens, swapped) = cache.seq_len_and_tier(seq_id)?;
            let computed = self.request(seq_id)?.num_computed;
            ensure!(
                !swapped && num_tokens >= computed,
                "sequence {seq_id} is running but the cache holds it {} with {num_tokens} \
                 tokens for {computed} computed (changed behind the scheduler's back)",
                if swapped {
                    "swapped out"
                } else {
                    "on the device"
                }
            );
        }
        for &seq_id in &self.loading {
            ensure!(
                !cache.seq_len_and_tier(seq_id)?.1,
                "sequence {seq_id} is loading but the cache holds it swapped out (changed \
                 behind the scheduler's back)"
            );
        }
        for &(_, _, seq_id) in &self.swapped {
            ensure!(
                cache.seq_len_and_tier(seq_id)?.1,
                "sequence {seq_id} is swapped out but the cache holds it on the device \
                 (changed behind the scheduler's back)"
            );
        }
        // A step admits at most one waiting request per free seat, the arrived ones in queue
        // order (see `admit_waiting`).
        let free_seats = self.config.max_num_seqs.saturating_sub(self.seats_taken());
        let admissible = self.waiting.iter().map(|key| key.2).filter(|id| {
            self.requests
                .get(id)
                .is_some_and(|r| r.arrival_ns <= now_ns && !r.awaiting_token)
        });
        for seq_id in admissible.take(free_seats) {
            if cache.contains(seq_id) {
                return Err(CoreError::DuplicateSequence(seq_id));
            }
        }
        Ok(())
    }

    /// Checks the scheduler's bookkeeping against the cache (for tests).
    pub fn check_invariants(&self, cache: &KvCache) -> Result<(), String> {
        let unforked: usize = self.requests.values().map(|r| r.samples_to_fork).sum();
        if unforked != self.unforked_samples {
            return Err(format!(
                "{unforked} samples to fork, counted {}",
                self.unforked_samples
            ));
        }
        for (&seq_id, request) in &self.requests {
            let key = request.queue_key(seq_id);
            let queued = (
                self.waiting.contains(&key),
                self.swapped.contains(&key),
                self.running.contains(&seq_id),
                self.loading.contains(&seq_id),
            );
            let expected = match request.state {
                State::Waiting => (true, false, false, false),
                State::Swapped => (false, true, false, false),
                State::Running => (false, false, true, false),
                State::Loading => (false, false, false, true),
            };
            if queued != expected {
                return Err(format!(
                    "request {seq_id} is {:?} but queued as {queued:?}",
                    request.state,
                ));
            }
            if (request.state == State::Loading) != (request.loading_blocks > 0) {
                return Err(format!("request {seq_id}: {request:?} loading"));
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
        let seated = self.running.len() + self.loading.len();
        if seated > self.config.max_num_seqs + self.forked_since_step {
            return Err(format!(
                "{seated} running or loading > max_num_seqs {} (+ {} forked since the step)",
                self.config.max_num_seqs, self.forked_since_step
            ));
        }
        let queued = self.waiting.len() + self.swapped.len() + self.running.len();
        if queued + self.loading.len() != self.requests.len() {
            return Err("queues and requests disagree".into());
        }
        for &seq_id in &self.abandoned_loads {
            if self.requests.contains_key(&seq_id) || !cache.contains(seq_id) {
                return Err(format!(
                    "abandoned load {seq_id} is a request, or off the cache"
                ));
            }
        }
        cache.check_invariants()
    }
}
