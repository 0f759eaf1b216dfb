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

impl SchedulerConfig {
    pub fn validate(&self) -> CoreResult<()> {
        ensure!(
            self.max_num_seqs > 0 && self.max_num_batched_tokens > 0,
            "max_num_seqs and max_num_batched_tokens must be at least 1"
        );
        ensure!(
            (0.0..1.0).contains(&self.watermark),
            "watermark must be in [0, 1), got {}",
            self.watermark
        );
        Ok(())
    }

    /// Valid, and possible with this cache.
    pub(super) fn validate_for(&self, cache: &KvCache) -> CoreResult<()> {
        self.validate()?;
        ensure!(
            self.preemption != Preemption::Swap || cache.num_host_blocks() > 0,
            "preemption=\"swap\" needs a KV cache with a host tier (num_host_blocks)"
        );
        Ok(())
    }
}
