//! Running a checked call: its (row, KV head) pieces spread over a thread pool, each piece's
//! code the copy of the kernel compiled for the best vector instructions this CPU has.
//!
//! The kernel (`kernel::attend`) is inlined into one function per instruction set, each
//! compiled with that set's target features; which one runs is decided once per call from
//! what the CPU reports (tests run each copy the CPU has). Threads come from a pool kept for the size last asked for (the
//! caller passes torch's thread count); one thread runs on the caller's own.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::element::Element;
use super::kernel::{self, Output, Scratch, WorkItem, TOKEN_TILE};
use super::PagedAttention;
use crate::error::CoreResult;

type Piece<E> = unsafe fn(&PagedAttention<'_, E>, WorkItem, &mut Scratch, Output<E>);

/// The vector instructions a copy of the kernel is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstructionSet {
    Avx512,
    Avx2,
    Portable,
}

impl InstructionSet {
    /// The best this CPU has.
    pub fn detected() -> Self {
        [InstructionSet::Avx512, InstructionSet::Avx2]
            .into_iter()
            .find(|set| set.available())
            .unwrap_or(InstructionSet::Portable)
    }

    /// Whether this CPU runs it.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        let fma = std::arch::is_x86_feature_detected!("fma");
        #[cfg(target_arch = "x86_64")]
        return match self {
            InstructionSet::Avx512 => fma && std::arch::is_x86_feature_detected!("avx512f"),
            InstructionSet::Avx2 => fma && std::arch::is_x86_feature_detected!("avx2"),
            InstructionSet::Portable => true,
        };
        #[cfg(not(target_arch = "x86_64"))]
        return self == InstructionSet::Portable;
    }

    fn piece<E: Element>(self) -> Piece<E> {
        match self {
            #[cfg(target_arch = "x86_64")]
            InstructionSet::Avx512 => piece_avx512::<E>,
            #[cfg(target_arch = "x86_64")]
            InstructionSet::Avx2 => piece_avx2::<E>,
            _ => piece_portable::<E>,
        }
    }
}

/// Runs a checked call on `threads` threads with the copy for `set`, which this CPU has.
pub(super) fn run<E: Element>(
    call: &PagedAttention<'_, E>,
    out: &mut [E],
    threads: usize,
    set: InstructionSet,
) -> CoreResult<()> {
    let piece = set.piece::<E>();
    let rows = call.rows.seq_lens.len();
    let kv_heads = call.shape.num_kv_heads;
    let output = Output(out.as_mut_ptr());
    let attend_row = |index: usize| {
        let (row, kv_head) = (index / kv_heads, index % kv_heads);
        let start = call.rows.query_start_loc[row] as u32;
        let end = call.rows.query_start_loc[row + 1] as u32;
        with_scratch(call, |scratch| {
            for first in (start..end).step_by(TOKEN_TILE) {
                let tokens = (first, (first + TOKEN_TILE as u32).min(end));
                let item = WorkItem {
                    row: row as u32,
                    kv_head: kv_head as u32,
                    tokens,
                };
                // Safety: the call was checked; pieces write disjoint (token, head) parts of
                // `out`, which outlives the pool's work (`install` returns after it).
                unsafe { piece(call, item, scratch, output) };
            }
        });
    };
    let pieces = rows * kv_heads;
    if threads == 1 || pieces < 2 {
        (0..pieces).for_each(attend_row);
    } else {
        pool(threads)?.install(|| (0..pieces).into_par_iter().for_each(attend_row));
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn piece_avx512<E: Element>(
    call: &PagedAttention<'_, E>,
    item: WorkItem,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    kernel::attend(call, item, scratch, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn piece_avx2<E: Element>(
    call: &PagedAttention<'_, E>,
    item: WorkItem,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    kernel::attend(call, item, scratch, out);
}

unsafe fn piece_portable<E: Element>(
    call: &PagedAttention<'_, E>,
    item: WorkItem,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    kernel::attend(call, item, scratch, out);
}

thread_local! {
    /// Each thread's buffers.
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

fn with_scratch<E: Element>(call: &PagedAttention<'_, E>, work: impl FnOnce(&mut Scratch)) {
    let shape = &call.shape;
    let sizes = (shape.num_heads / shape.num_kv_heads, shape.head_dim);
    SCRATCH.with(|cell| {
        let mut slot = cell.borrow_mut();
        let scratch = match slot.take() {
            Some(scratch) if scratch.sizes == sizes => slot.insert(scratch),
            _ => slot.insert(Scratch::new(sizes.0, sizes.1)),
        };
        work(scratch);
    });
}

/// Starts the pool for `threads` threads (none for one) if it is not running.
pub(super) fn start_threads(threads: usize) -> CoreResult<()> {
    if threads > 1 {
        pool(threads)?;
    }
    Ok(())
}

/// The pool of `threads` threads (rebuilt when another size is asked for).
fn pool(threads: usize) -> CoreResult<Arc<rayon::ThreadPool>> {
    static POOL: Mutex<Option<(usize, Arc<rayon::ThreadPool>)>> = Mutex::new(None);
    let mut held = POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((size, pool)) = held.as_ref() {
        if *size == threads {
            return Ok(Arc::clone(pool));
        }
    }
    let pool = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|index| format!("atb-mem-attention-{index}"))
            .build()?,
    );
    *held = Some((threads, Arc::clone(&pool)));
    Ok(pool)
}
