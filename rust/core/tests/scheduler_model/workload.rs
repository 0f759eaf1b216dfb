//! What the scheduler model runs: the operations, the layer kinds and configurations, the
//! token values, and the simulated KV memory a backing would hold.

use std::collections::HashMap;

use atb_mem_core::{AttentionKind, BlockMove, MoveKind, Preemption, SchedulerConfig};
use proptest::prelude::*;

/// The block size of a one-group cache; hybrid ones draw theirs (1 to 4).
pub const BLOCK_SIZE: usize = 2;
pub const NUM_BLOCKS: usize = 12;
pub const HOST_BLOCKS: usize = 8;
pub const STEPS: usize = 200;
/// What a slot holds after a move failed part-way through writing it.
pub const GARBAGE: u64 = u64::MAX;

#[derive(Debug, Clone)]
pub enum Op {
    Add {
        template: usize,
        keep: usize,
        tail: Vec<u32>,
        by_count: bool,
        max_new: usize,
        /// Samples the request runs side by side (forked at its first token).
        samples: usize,
    },
    /// Plan a step; if it has moves and `fail` is set, executing them fails at that move.
    Step {
        fail: Option<usize>,
    },
    Sample {
        token: u32,
    },
    Abort {
        pick: usize,
    },
    /// Fork a running sequence behind the scheduler's back (its next decode copies).
    Fork {
        pick: usize,
    },
    FreeFork {
        pick: usize,
    },
    /// Parallel sampling: fork a request the last step sampled, through the scheduler.
    ForkRequest {
        pick: usize,
    },
    /// Change a copy of the cache behind the scheduler's back; a step over it must fail
    /// and change nothing.
    Tamper {
        pick: usize,
        how: usize,
    },
    /// Report a lower-tier load in flight: its bytes arrived (`ok`), or it failed part-way.
    FinishLoad {
        pick: usize,
        ok: bool,
    },
    /// A prompt that continues an ended request's tokens with `tail` (see `turns`).
    NextTurn {
        pick: usize,
        tail: Vec<u32>,
        max_new: usize,
    },
}

pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..3, 0usize..9, prop::collection::vec(0u32..4, 1..7), prop::bool::weighted(0.2), 1usize..9, 1usize..3)
            .prop_map(|(template, keep, tail, by_count, max_new, samples)| Op::Add { template, keep, tail, by_count, max_new, samples }),
        6 => prop::option::weighted(0.5, 0usize..9).prop_map(|fail| Op::Step { fail }),
        4 => (0u32..4).prop_map(|token| Op::Sample { token }),
        1 => (0usize..16).prop_map(|pick| Op::Abort { pick }),
        3 => (0usize..16).prop_map(|pick| Op::Fork { pick }),
        1 => (0usize..16).prop_map(|pick| Op::FreeFork { pick }),
        2 => (0usize..16).prop_map(|pick| Op::ForkRequest { pick }),
        1 => (0usize..16, 0usize..3).prop_map(|(pick, how)| Op::Tamper { pick, how }),
    ]
}

/// Requests that come and finish steadily, so that a small device evicts prefixes that
/// later requests ask for again (a host prefix cache's workload), with failures injected.
pub fn tier_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..3, 2usize..9, prop::collection::vec(0u32..4, 1..4), Just(false), 1usize..4, Just(1usize))
            .prop_map(|(template, keep, tail, by_count, max_new, samples)| Op::Add { template, keep, tail, by_count, max_new, samples }),
        6 => prop::option::weighted(0.3, 0usize..9).prop_map(|fail| Op::Step { fail }),
        6 => (0u32..4).prop_map(|token| Op::Sample { token }),
        1 => (0usize..16).prop_map(|pick| Op::Abort { pick }),
        1 => (0usize..16).prop_map(|pick| Op::ForkRequest { pick }),
        3 => (0usize..16, prop::bool::weighted(0.8)).prop_map(|(pick, ok)| Op::FinishLoad { pick, ok }),
    ]
}

/// Layer kinds of the model and the block size: one full-attention layer (today's caches),
/// or a mix of full, sliding-window and chunked layers (KV-cache groups).
pub type LayerKinds = (Vec<AttentionKind>, usize);

pub fn layer_kinds() -> impl Strategy<Value = LayerKinds> {
    let kind = prop_oneof![
        Just(AttentionKind::Full),
        (1usize..6).prop_map(|window| AttentionKind::SlidingWindow { window }),
        (1usize..6).prop_map(|chunk| AttentionKind::ChunkedLocal { chunk }),
    ];
    prop_oneof![
        Just((vec![AttentionKind::Full], BLOCK_SIZE)),
        (prop::collection::vec(kind, 1..5), 1usize..5),
    ]
}

pub fn config() -> impl Strategy<Value = SchedulerConfig> {
    (1usize..5, 2usize..12, any::<bool>(), any::<bool>()).prop_map(
        |(max_num_seqs, max_num_batched_tokens, chunked, swap)| SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: if chunked { max_num_batched_tokens } else { 64 },
            enable_chunked_prefill: chunked,
            preemption: if swap {
                Preemption::Swap
            } else {
                Preemption::Recompute
            },
            watermark: 0.0,
        },
    )
}

pub const TEMPLATES: [[u32; 8]; 6] = [
    [1, 2, 3, 1, 2, 3, 1, 2],
    [1, 2, 3, 0, 0, 1, 1, 0],
    [3, 3, 2, 2, 1, 1, 0, 0],
    // More prompts than a small device keeps cached: a host prefix cache's workload.
    [0, 1, 0, 1, 2, 2, 3, 3],
    [2, 0, 3, 1, 2, 0, 3, 1],
    [3, 1, 1, 0, 2, 3, 0, 2],
];

/// K/V value of a token: its id and position for known ids (so equal prefixes hold equal
/// bytes), or something unique to the sequence for a prompt given as a count.
pub fn value(seq_id: u64, token: Option<u32>, position: usize) -> u64 {
    match token {
        Some(token) => ((token as u64) << 32) | position as u64,
        None => (1 << 63) | (seq_id << 32) | position as u64,
    }
}

#[derive(Clone)]
pub struct Memory {
    pub block_size: usize,
    pub device: HashMap<usize, u64>,
    pub host: HashMap<usize, u64>,
}

impl Memory {
    pub fn tier(&mut self, host: bool) -> &mut HashMap<usize, u64> {
        if host {
            &mut self.host
        } else {
            &mut self.device
        }
    }

    pub fn execute(&mut self, planned: &BlockMove, garbage: bool) {
        let (from_host, to_host) = match planned.kind {
            MoveKind::Copy => (false, false),
            MoveKind::ToHost => (false, true),
            MoveKind::ToDevice => (true, false),
        };
        let block_size = self.block_size;
        for offset in 0..block_size {
            let src = planned.src as usize * block_size + offset;
            let dst = planned.dst as usize * block_size + offset;
            let moved = match garbage {
                true => Some(GARBAGE),
                false => self.tier(from_host).get(&src).copied(),
            };
            match moved {
                Some(moved) => self.tier(to_host).insert(dst, moved),
                None => self.tier(to_host).remove(&dst),
            };
        }
    }
}
