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
            let (num_tokens, swapped) = cache.seq_state(seq_id)?;
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
        for &(_, _, seq_id) in &self.swapped {
            ensure!(
                cache.seq_state(seq_id)?.1,
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
        if self.running.len() > self.config.max_num_seqs + self.forked_since_step {
            return Err(format!(
                "{} running > max_num_seqs {} (+ {} forked since the step)",
                self.running.len(),
                self.config.max_num_seqs,
                self.forked_since_step
            ));
        }
        if self.waiting.len() + self.swapped.len() + self.running.len() != self.requests.len() {
            return Err("queues and requests disagree".into());
        }
        cache.check_invariants()
    }
}
