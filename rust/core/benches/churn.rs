//! Churn at high occupancy, TLSF pool against a first-fit allocator written here for the
//! comparison: `cargo bench -p atb-mem-core --bench churn`.
//!
//! 1,000,000 operations with sizes log-uniform from 4 KiB to 4 MiB, allocating while the pool
//! is under 80% full and freeing a random live allocation otherwise. Fragmentation is sampled
//! every 100,000 operations. Then, from the churned state, random sizes from the same range
//! are allocated until the first failure, and the fill at that point is reported. Both
//! allocators see the same random stream and count in the same 64-byte units.

use std::collections::BTreeMap;

use atb_mem_core::{AlignmentPolicy, MemPool, PoolAllocation};

const CAPACITY: u64 = 1 << 30;
const ALIGNMENT: u64 = 64;
const OPERATIONS: usize = 1_000_000;
const TARGET_FILL: f64 = 0.8;

/// splitmix64: a small deterministic generator, so the run needs no extra crate.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Log-uniform in [4 KiB, 4 MiB].
    fn size(&mut self) -> u64 {
        let (low, high) = ((4096f64).ln(), ((4u64 << 20) as f64).ln());
        (low + self.unit() * (high - low)).exp() as u64
    }
}

trait Allocator {
    type Handle: Copy;
    fn malloc(&mut self, size: u64) -> Option<(Self::Handle, u64)>;
    fn free(&mut self, handle: Self::Handle);
    /// (fragmentation = 1 − largest/free, Sawicki's metric, free ranges)
    fn fragmentation(&self) -> (f64, f64, usize);
}

impl Allocator for MemPool {
    type Handle = PoolAllocation;

    fn malloc(&mut self, size: u64) -> Option<(PoolAllocation, u64)> {
        MemPool::malloc(self, size).ok().map(|a| (a, a.size))
    }

    fn free(&mut self, handle: PoolAllocation) {
        MemPool::free(self, handle.pool_id, handle.node, handle.generation).unwrap();
    }

    fn fragmentation(&self) -> (f64, f64, usize) {
        let stats = self.stats();
        (
            stats.fragmentation,
            stats.sawicki_fragmentation,
            stats.free_ranges as usize,
        )
    }
}

/// First fit over free ranges kept in address order; merges on free.
struct FirstFit {
    free: BTreeMap<u64, u64>,
}

impl FirstFit {
    fn new() -> Self {
        FirstFit {
            free: BTreeMap::from([(0, CAPACITY / ALIGNMENT)]),
        }
    }
}

impl Allocator for FirstFit {
    type Handle = (u64, u64);

    fn malloc(&mut self, size: u64) -> Option<((u64, u64), u64)> {
        let units = size.div_ceil(ALIGNMENT);
        let (&offset, &free) = self.free.iter().find(|&(_, &free)| free >= units)?;
        self.free.remove(&offset);
        if free > units {
            self.free.insert(offset + units, free - units);
        }
        Some(((offset, units), units * ALIGNMENT))
    }

    fn free(&mut self, (mut offset, mut units): (u64, u64)) {
        if let Some((&before, &size)) = self.free.range(..offset).next_back() {
            if before + size == offset {
                self.free.remove(&before);
                offset = before;
                units += size;
            }
        }
        if let Some(&size) = self.free.get(&(offset + units)) {
            self.free.remove(&(offset + units));
            units += size;
        }
        self.free.insert(offset, units);
    }

    fn fragmentation(&self) -> (f64, f64, usize) {
        let total: u64 = self.free.values().sum();
        let largest = self.free.values().copied().max().unwrap_or(0);
        let squares: f64 = self.free.values().map(|&f| (f as f64).powi(2)).sum();
        if total == 0 {
            return (0.0, 0.0, 0);
        }
        (
            1.0 - largest as f64 / total as f64,
            1.0 - squares.sqrt() / total as f64,
            self.free.len(),
        )
    }
}

struct Report {
    samples: Vec<(usize, f64, f64, usize, f64)>,
    churn_ooms: usize,
    fill_at_first_failure: f64,
    seconds: f64,
}

fn churn<A: Allocator>(allocator: &mut A) -> Report {
    let mut random = Random(20240607);
    let mut live: Vec<(A::Handle, u64)> = Vec::new();
    let mut used = 0u64;
    let mut samples = Vec::new();
    let mut churn_ooms = 0;
    let start = std::time::Instant::now();
    for operation in 1..=OPERATIONS {
        if (used as f64) < TARGET_FILL * CAPACITY as f64 || live.is_empty() {
            match allocator.malloc(random.size()) {
                Some((handle, size)) => {
                    live.push((handle, size));
                    used += size;
                }
                None => churn_ooms += 1,
            }
        } else {
            let (handle, size) = live.swap_remove((random.next() % live.len() as u64) as usize);
            allocator.free(handle);
            used -= size;
        }
        if operation % 100_000 == 0 {
            let (fragmentation, sawicki, ranges) = allocator.fragmentation();
            samples.push((
                operation,
                fragmentation,
                sawicki,
                ranges,
                used as f64 / CAPACITY as f64,
            ));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let fill_at_first_failure = loop {
        match allocator.malloc(random.size()) {
            Some((_, size)) => used += size,
            None => break used as f64 / CAPACITY as f64,
        }
    };
    Report {
        samples,
        churn_ooms,
        fill_at_first_failure,
        seconds,
    }
}

fn main() {
    let mut pool = MemPool::new(CAPACITY, ALIGNMENT, AlignmentPolicy::Default, 1 << 16).unwrap();
    let tlsf = churn(&mut pool);
    pool.check_invariants().unwrap();
    let first_fit = churn(&mut FirstFit::new());
    println!("churn: {OPERATIONS} operations, 4 KiB–4 MiB log-uniform, held near {TARGET_FILL:.0$} full of 1 GiB", 1);
    println!("{:>9} | {:>22} | {:>22}", "", "TLSF MemPool", "first fit");
    println!(
        "{:>9} | {:>6} {:>7} {:>7} | {:>6} {:>7} {:>7}",
        "operation", "frag", "sawicki", "ranges", "frag", "sawicki", "ranges"
    );
    for (a, b) in tlsf.samples.iter().zip(&first_fit.samples) {
        println!(
            "{:>9} | {:>6.3} {:>7.3} {:>7} | {:>6.3} {:>7.3} {:>7}   (fill {:.3} / {:.3})",
            a.0, a.1, a.2, a.3, b.1, b.2, b.3, a.4, b.4
        );
    }
    let mean = |report: &Report, pick: fn(&(usize, f64, f64, usize, f64)) -> f64| {
        report.samples.iter().map(pick).sum::<f64>() / report.samples.len() as f64
    };
    for (name, report) in [("TLSF MemPool", &tlsf), ("first fit", &first_fit)] {
        println!(
            "{name:>12}: mean fragmentation {:.3}, mean Sawicki {:.3}, OOMs during churn {}, \
             fill at first failure {:.1}%, churn {:.0} ns/op",
            mean(report, |s| s.1),
            mean(report, |s| s.2),
            report.churn_ooms,
            100.0 * report.fill_at_first_failure,
            report.seconds * 1e9 / OPERATIONS as f64
        );
    }
}
