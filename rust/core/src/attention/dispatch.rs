//! Running a checked call: its (row, KV head) pieces spread over threads, each piece's code
//! the copy of the kernel compiled for the best vector instructions this CPU has.
//!
//! The kernel (`kernel::attend`) is inlined into one function per instruction set, each
//! compiled with that set's target features and naming its decode scores (`KeyScores`);
//! which one runs is decided once per call from what the CPU reports (tests run each copy
//! the CPU has).
//!
//! Threads (the caller passes torch's count) are those of the process's OpenMP runtime once
//! `use_openmp` has named it: torch's operators run on that team, whose threads spin for a
//! while after each operator, so a pool of the kernel's own would share the cores with them
//! (a third slower on two cores, measured). Until then they come from a pool kept for the
//! size last asked for.

use std::cell::RefCell;
use std::ffi::{c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

use super::element::Element;
use super::item::{Output, Scratch, WorkItem, TOKEN_TILE};
use super::kernel;
#[cfg(target_arch = "x86_64")]
use super::lanes::Avx512;
use super::lanes::Portable;
use super::PagedAttention;
use crate::error::CoreResult;

/// An OpenMP runtime's fork-join entry, with `GOMP_parallel`'s signature (libgomp's; LLVM's
/// and Intel's runtimes export it too): runs `work(data)` on the calling thread and on
/// `threads - 1` threads of its team, and returns when every one has.
pub type OpenMpParallel = unsafe extern "C" fn(
    work: unsafe extern "C" fn(*mut c_void),
    data: *mut c_void,
    threads: c_uint,
    flags: c_uint,
);

static OPENMP: OnceLock<OpenMpParallel> = OnceLock::new();

/// Runs every later call's threads on `parallel`'s team instead of a pool of the kernel's
/// own. Once per process: naming another runtime later is an error.
///
/// # Safety
/// `parallel` is an OpenMP runtime's `GOMP_parallel`, loaded for the life of the process.
pub unsafe fn use_openmp(parallel: OpenMpParallel) -> CoreResult<()> {
    let held = *OPENMP.get_or_init(|| parallel);
    ensure!(
        std::ptr::fn_addr_eq(held, parallel),
        "the attention threads already run on another OpenMP runtime"
    );
    Ok(())
}

type Piece<E, C> = unsafe fn(&PagedAttention<'_, E, C>, WorkItem, &mut Scratch, Output<E>);

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

    fn piece<E: Element, C: Element>(self) -> Piece<E, C> {
        match self {
            #[cfg(target_arch = "x86_64")]
            InstructionSet::Avx512 => piece_avx512::<E, C>,
            #[cfg(target_arch = "x86_64")]
            InstructionSet::Avx2 => piece_avx2::<E, C>,
            _ => piece_portable::<E, C>,
        }
    }
}

/// Runs a checked call on `threads` threads with the copy for `set`, which this CPU has.
pub(super) fn run<E: Element, C: Element>(
    call: &PagedAttention<'_, E, C>,
    out: &mut [E],
    threads: usize,
    set: InstructionSet,
) -> CoreResult<()> {
    let piece = set.piece::<E, C>();
    let rows = call.rows.seq_lens.len();
    let kv_heads = call.shape.num_kv_heads;
    let decode_heads = decode_heads(rows, kv_heads, threads);
    let output = Output(out.as_mut_ptr());
    let attend_row = |index: usize| {
        let (row, kv_head) = (index / kv_heads, index % kv_heads);
        // A decode's piece attends `decode_heads` KV heads; the pieces of the others it
        // covers have nothing left to do.
        let heads = if call.rows.query_len(row) == 1 {
            decode_heads
        } else {
            1
        };
        if kv_head % heads != 0 {
            return;
        }
        let start = call.rows.query_start_loc[row] as u32;
        let end = call.rows.query_start_loc[row + 1] as u32;
        with_scratch(call, |scratch| {
            for first in (start..end).step_by(TOKEN_TILE) {
                let tokens = (first, (first + TOKEN_TILE as u32).min(end));
                let item = WorkItem {
                    row: row as u32,
                    kv_head: kv_head as u32,
                    kv_heads: heads as u32,
                    tokens,
                };
                // Safety: the call was checked; pieces write disjoint (token, head) parts of
                // `out`, which outlives the threads' work (`install` and `GOMP_parallel`
                // return after it).
                unsafe { piece(call, item, scratch, output) };
            }
        });
    };
    for_each_piece(threads, rows * kv_heads, &attend_row)
}

/// Runs `work` for every piece of `0..pieces` on up to `threads` threads: the OpenMP team's
/// once `use_openmp` named it, else the kernel's own pool.
pub fn for_each_piece(
    threads: usize,
    pieces: usize,
    work: &(dyn Fn(usize) + Sync),
) -> CoreResult<()> {
    if threads == 1 || pieces < 2 {
        (0..pieces).for_each(work);
    } else if let Some(&parallel) = OPENMP.get() {
        // Safety: `use_openmp`'s contract.
        unsafe { fork_join(parallel, threads.min(pieces), pieces, work)? };
    } else {
        pool(threads)?.install(|| (0..pieces).into_par_iter().for_each(work));
    }
    Ok(())
}

/// How many KV heads one piece of a decode row attends (`decode`): as many as keep at least
/// four pieces per thread over `rows` rows, a divisor of `kv_heads`.
fn decode_heads(rows: usize, kv_heads: usize, threads: usize) -> usize {
    (1..=kv_heads)
        .rev()
        .find(|&heads| kv_heads.is_multiple_of(heads) && rows * (kv_heads / heads) >= 4 * threads)
        .unwrap_or(1)
}

/// Pieces `0..pieces` handed out one at a time to whichever thread of the team asks next.
struct Job<'a> {
    work: &'a (dyn Fn(usize) + Sync),
    next: AtomicUsize,
    pieces: usize,
    panicked: AtomicBool,
}

/// Runs `work` for every piece on `threads` threads of `parallel`'s team.
///
/// # Safety
/// `parallel` behaves as `GOMP_parallel`.
unsafe fn fork_join(
    parallel: OpenMpParallel,
    threads: usize,
    pieces: usize,
    work: &(dyn Fn(usize) + Sync),
) -> CoreResult<()> {
    let job = Job {
        work,
        next: AtomicUsize::new(0),
        pieces,
        panicked: AtomicBool::new(false),
    };
    let threads = c_uint::try_from(threads).unwrap_or(c_uint::MAX);
    parallel(take_pieces, &job as *const Job as *mut c_void, threads, 0);
    ensure!(
        !job.panicked.load(Ordering::Relaxed),
        "an attention thread failed"
    );
    Ok(())
}

/// One team thread's share of a `Job`. A panic stops at the C boundary, as it must.
unsafe extern "C" fn take_pieces(data: *mut c_void) {
    // Safety: `fork_join` passes its `Job`, which outlives the team's work.
    let job = &*(data as *const Job);
    let taken = catch_unwind(AssertUnwindSafe(|| loop {
        let piece = job.next.fetch_add(1, Ordering::Relaxed);
        if piece >= job.pieces {
            break;
        }
        (job.work)(piece);
    }));
    if taken.is_err() {
        job.panicked.store(true, Ordering::Relaxed);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn piece_avx512<E: Element, C: Element>(
    call: &PagedAttention<'_, E, C>,
    item: WorkItem,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    kernel::attend::<E, C, Avx512>(call, item, scratch, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn piece_avx2<E: Element, C: Element>(
    call: &PagedAttention<'_, E, C>,
    item: WorkItem,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    kernel::attend::<E, C, Portable>(call, item, scratch, out);
}

unsafe fn piece_portable<E: Element, C: Element>(
    call: &PagedAttention<'_, E, C>,
    item: WorkItem,
    scratch: &mut Scratch,
    out: Output<E>,
) {
    kernel::attend::<E, C, Portable>(call, item, scratch, out);
}

thread_local! {
    /// Each thread's buffers.
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

fn with_scratch<E, C>(call: &PagedAttention<'_, E, C>, work: impl FnOnce(&mut Scratch)) {
    let shape = &call.shape;
    let sizes = (
        shape.num_heads / shape.num_kv_heads,
        shape.head_dim,
        shape.num_heads,
    );
    SCRATCH.with(|cell| {
        let mut slot = cell.borrow_mut();
        let scratch = match slot.take() {
            Some(scratch) if scratch.sizes == sizes => slot.insert(scratch),
            _ => slot.insert(Scratch::new(shape)),
        };
        work(scratch);
    });
}

/// Starts the pool for `threads` threads (none for one, or on OpenMP's) if it is not running.
pub(super) fn start_threads(threads: usize) -> CoreResult<()> {
    if threads > 1 && OPENMP.get().is_none() {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `GOMP_parallel`'s contract, with scoped threads for a team.
    unsafe extern "C" fn scoped_team(
        work: unsafe extern "C" fn(*mut c_void),
        data: *mut c_void,
        threads: c_uint,
        _flags: c_uint,
    ) {
        let data = data as usize;
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(move || unsafe { work(data as *mut c_void) });
            }
            unsafe { work(data as *mut c_void) };
        });
    }

    #[test]
    fn a_team_takes_every_piece_once() {
        let counts: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
        let count = |piece: usize| {
            counts[piece].fetch_add(1, Ordering::Relaxed);
        };
        unsafe { fork_join(scoped_team, 3, counts.len(), &count) }.unwrap();
        assert!(counts
            .iter()
            .all(|count| count.load(Ordering::Relaxed) == 1));
    }

    unsafe extern "C" fn another_team(
        work: unsafe extern "C" fn(*mut c_void),
        data: *mut c_void,
        threads: c_uint,
        flags: c_uint,
    ) {
        scoped_team(work, data, threads, flags)
    }

    #[test]
    fn the_runtime_is_named_once() {
        unsafe {
            use_openmp(scoped_team).unwrap();
            use_openmp(scoped_team).unwrap();
            let refused = use_openmp(another_team).unwrap_err();
            assert!(refused.to_string().contains("another OpenMP runtime"));
        }
    }

    #[test]
    fn a_panicking_piece_is_an_error_not_an_unwind() {
        let fail = |piece: usize| assert_ne!(piece, 7, "piece 7 fails");
        let result = unsafe { fork_join(scoped_team, 2, 20, &fail) };
        assert!(result
            .unwrap_err()
            .to_string()
            .contains("attention thread failed"));
    }
}
