//! What an operator sets: the batch limits, chunked prefill, the preemption mode and the
//! watermark. Validated as a whole; `set_config` swaps it atomically.

use crate::error::CoreResult;
use crate::kv_cache::KvCache;

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
            other => Err(invalid!(
                "preemption must be \"recompute\" or \"swap\", got {other:?}"
            )),
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

/// Most sequences a step may run: far beyond any batch a device holds, and a bound that keeps
/// a mistyped setting from sizing the step's buffers.
pub const MAX_NUM_SEQS: usize = 1 << 20;

/// Most tokens a step may batch: positions and slots are int32.
pub const MAX_NUM_BATCHED_TOKENS: usize = i32::MAX as usize;

impl SchedulerConfig {
    pub fn validate(&self) -> CoreResult<()> {
        ensure!(
            (1..=MAX_NUM_SEQS).contains(&self.max_num_seqs),
            "max_num_seqs must be in [1, {MAX_NUM_SEQS}], got {}",
            self.max_num_seqs
        );
        ensure!(
            (1..=MAX_NUM_BATCHED_TOKENS).contains(&self.max_num_batched_tokens),
            "max_num_batched_tokens must be in [1, {MAX_NUM_BATCHED_TOKENS}], got {}",
            self.max_num_batched_tokens
        );
        ensure!(
            (0.0..1.0).contains(&self.watermark),
            "watermark must be in [0, 1), got {}",
            self.watermark
        );
        Ok(())
    }

    /// Valid, and possible with this cache: a swap needs a host tier, and the watermark
    /// must leave room for a request (a one-token prompt and one new token).
    pub(super) fn validate_for(&self, cache: &KvCache) -> CoreResult<()> {
        self.validate()?;
        ensure!(
            self.preemption != Preemption::Swap || cache.num_host_blocks() > 0,
            "preemption=\"swap\" needs a KV cache with a host tier (num_host_blocks)"
        );
        let room = self.room(cache);
        ensure!(
            room >= 2,
            "watermark={} leaves room for {room} token(s) per request in this cache of {} \
             blocks: no request could ever be admitted",
            self.watermark,
            cache.num_blocks()
        );
        Ok(())
    }

    /// Blocks admission and swap-in leave free.
    pub(super) fn watermark_blocks(&self, cache: &KvCache) -> usize {
        (self.watermark * cache.num_blocks() as f64).ceil() as usize
    }

    /// Most tokens one request may hold to be admitted at all.
    pub(super) fn room(&self, cache: &KvCache) -> usize {
        cache
            .tokens_in_blocks((cache.num_blocks() - 1).saturating_sub(self.watermark_blocks(cache)))
    }
}
