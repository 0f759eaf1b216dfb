//! Paged attention on the CPU, over the KV cache's own blocks: ATB's fused operator idea
//! (one call does what a framework spreads over gathers, masks, a softmax and matmuls), for
//! the devices that have no such kernel of their own. On CUDA and Ascend the device's
//! kernels (FlashInfer, ATB's PagedAttention) read the same layout.
//!
//! One call attends a step's rows — decodes and prefill chunks alike, described as vLLM
//! does (`query_start_loc`, `seq_lens`, block tables) — reading K/V in place from
//! `[slots, kv_heads, head_dim]` caches through the rows' block tables: no gathered copy, no
//! mask tensor. Row `r`'s new tokens sit at the last `query_len` positions of its
//! `seq_len`; each attends causally, within its window or chunk (`Visibility`), with
//! grouped-query heads, and optionally gpt-oss's per-head sink logit. The softmax is online
//! (`kernel`), in `f32` whatever the element type (`element`: f32, bf16, f16).
//!
//! Work is split by (row, KV head), a decode row's KV heads a few to a piece (`decode`), over
//! the caller's number of threads (torch's OpenMP team once `use_openmp` names it, else a
//! pool of the kernel's own), and each piece runs code compiled for AVX-512 or AVX2 when the
//! CPU has them (`dispatch`), else portable code. Every input is checked once per call (`check`) before anything is read.

mod check;
mod decode;
mod dispatch;
mod element;
mod item;
mod kernel;
mod lane_tile;
mod lanes;
mod slots;

pub use dispatch::{for_each_piece, use_openmp, InstructionSet, OpenMpParallel};
pub use element::{Element, Fp8E4m3Code, Int8Code};
pub use half::{bf16, f16};
pub use slots::{write_slots, NewKv};

use crate::error::{CoreError, CoreResult};

/// The most threads a call may ask for (a pool of this many is started once).
pub const MAX_THREADS: usize = 1024;

/// The heads and blocks of one model's layer: `num_heads` query heads share `num_kv_heads`
/// KV heads (grouped-query attention), each `head_dim` wide; a block holds `block_size`
/// slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// A step's rows, as vLLM's attention metadata says them (all int32): row `r`'s new tokens
/// are `query_start_loc[r]..query_start_loc[r + 1]` of the step's tokens, the last of its
/// `seq_lens[r]` positions; its blocks are `block_tables[r * width..(r + 1) * width]`.
#[derive(Debug, Clone, Copy)]
pub struct StepRows<'a> {
    pub query_start_loc: &'a [i32],
    pub seq_lens: &'a [i32],
    pub block_tables: &'a [i32],
    pub width: usize,
}

/// Which earlier positions a query attends (its own always).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visibility {
    /// Every earlier position.
    Causal,
    /// The last `window` positions, its own included (transformers' `sliding_window`).
    Sliding { window: usize },
    /// The earlier positions of its own `chunk`-sized chunk (Llama 4's chunked attention).
    Chunked { chunk: usize },
}

/// One layer's attention for one step: `query` `[tokens, num_heads, head_dim]`, the caches
/// `[slots, num_kv_heads, row]` (slot = block × block_size + offset), a row being `head_dim`
/// elements of `C`, or a quantized row of `head_dim` codes and their scale (`Int8Code`,
/// `Fp8E4m3Code`: read in place, dequantized a row at a time).
#[derive(Debug, Clone, Copy)]
pub struct PagedAttention<'a, E, C = E> {
    pub shape: AttentionShape,
    pub rows: StepRows<'a>,
    pub query: &'a [E],
    pub key_cache: &'a [C],
    pub value_cache: &'a [C],
    pub visibility: Visibility,
    /// Multiplies every score (usually `head_dim ** -0.5`).
    pub scale: f32,
    /// gpt-oss's learned logit per query head, which takes a share of the softmax and
    /// carries no value.
    pub sinks: Option<&'a [f32]>,
}

impl StepRows<'_> {
    /// How many new tokens row `row` has.
    pub(crate) fn query_len(&self, row: usize) -> usize {
        (self.query_start_loc[row + 1] - self.query_start_loc[row]) as usize
    }
}

impl<E: Element, C: Element> PagedAttention<'_, E, C> {
    /// Attends every row into `out` (`[tokens, num_heads, head_dim]`) on `threads` threads.
    /// Checks every input first: a bad one is an error and `out` is left as it was.
    pub fn run(&self, out: &mut [E], threads: usize) -> CoreResult<()> {
        self.run_with(out, threads, InstructionSet::detected())
    }

    /// `run`, with the kernel's copy for `set` (which this CPU must have): how tests reach
    /// every copy.
    pub fn run_with(&self, out: &mut [E], threads: usize, set: InstructionSet) -> CoreResult<()> {
        self.validate(out.len(), threads)?;
        ensure!(set.available(), "this CPU has no {set:?} instructions");
        dispatch::run(self, out, threads, set)
    }

    /// Everything `run` checks (with an output of `out_len` elements), and its threads
    /// started: after this, `run` with the same inputs fails at nothing. A caller that writes
    /// the step's new K/V first (`write_slots`) validates before it, so that a refused call
    /// changes nothing.
    pub fn validate(&self, out_len: usize, threads: usize) -> CoreResult<()> {
        self.check(out_len)?;
        ensure!(
            (1..=MAX_THREADS).contains(&threads),
            "threads must be 1 to {MAX_THREADS}, got {threads}"
        );
        dispatch::start_threads(threads)
    }
}

impl From<rayon::ThreadPoolBuildError> for CoreError {
    fn from(error: rayon::ThreadPoolBuildError) -> Self {
        invalid!("cannot start the attention threads: {error}")
    }
}
