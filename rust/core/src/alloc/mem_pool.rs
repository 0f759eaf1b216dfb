//! An acl-like byte pool: one region reserved up front, `malloc`/`free` of any size inside
//! it, in O(1), with handles that catch double frees and foreign or stale handles.
//!
//! The pool hands out offsets; whoever owns the region's bytes (a host buffer, a device
//! tensor) turns them into pointers and views. Sizes are rounded to the pool's alignment, the
//! unit the range allocator counts in, so every offset is aligned by construction.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::alloc::fallible::check_bookkeeping;
use crate::alloc::range_allocator::{AllocFailure, RangeAllocator};
use crate::error::{CoreError, CoreResult};
use crate::figures::{Figure, Figures};

/// Largest region a pool manages.
pub const MAX_CAPACITY: u64 = 1 << 48;

/// Most live allocations a pool is sized for (its node store then takes 4 GiB).
pub const MAX_ALLOCATIONS: u32 = 1 << 26;

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// How a request's size and start are rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlignmentPolicy {
    /// Round the size up to the alignment.
    Default,
    /// CANN's rule for self-managed sub-allocation: n bytes take ALIGN_UP(n, 32) + 32 and
    /// start on a 64-byte boundary.
    Ascend,
}

impl AlignmentPolicy {
    pub fn parse(name: &str) -> CoreResult<AlignmentPolicy> {
        match name {
            "default" => Ok(AlignmentPolicy::Default),
            "ascend" => Ok(AlignmentPolicy::Ascend),
            other => Err(invalid!(
                "unknown policy {other:?}: expected \"default\" or \"ascend\""
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AlignmentPolicy::Default => "default",
            AlignmentPolicy::Ascend => "ascend",
        }
    }
}

/// A live allocation: its bytes `[offset, offset + size)` and the handle that frees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolAllocation {
    pub offset: u64,
    /// Usable bytes (the request, rounded up by the policy).
    pub size: u64,
    pub pool_id: u64,
    pub node: u32,
    pub generation: u32,
}

/// Counters reported by [`MemPool::stats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemPoolStats {
    pub capacity: u64,
    pub alignment: u64,
    pub policy: AlignmentPolicy,
    pub allocated_bytes: u64,
    pub allocated_bytes_peak: u64,
    pub requested_bytes: u64,
    pub reserved_bytes: u64,
    pub reserved_bytes_peak: u64,
    pub free_bytes: u64,
    pub largest_free: u64,
    /// 1 − largest_free / free_bytes (0 when the free space is one range or none).
    pub fragmentation: f64,
    /// Sawicki's 1 − sqrt(Σ fᵢ²) / Σ fᵢ over free ranges.
    pub sawicki_fragmentation: f64,
    pub active_allocations: u64,
    pub free_ranges: u64,
    pub num_allocs: u64,
    pub num_frees: u64,
    pub num_ooms: u64,
    pub max_allocations: u64,
}

/// Named as torch's `memory_stats()` names them, where it has the figure.
impl Figures for MemPoolStats {
    fn figures(&self) -> Vec<(&'static str, Figure)> {
        figures![
            "capacity" => self.capacity,
            "alignment" => self.alignment,
            "policy" => self.policy.name(),
            "allocated_bytes.current" => self.allocated_bytes,
            "allocated_bytes.peak" => self.allocated_bytes_peak,
            "requested_bytes.current" => self.requested_bytes,
            "reserved_bytes.current" => self.reserved_bytes,
            "reserved_bytes.peak" => self.reserved_bytes_peak,
            "active_allocations.current" => self.active_allocations,
            "free_bytes" => self.free_bytes,
            "largest_free" => self.largest_free,
            "free_ranges" => self.free_ranges,
            "fragmentation" => self.fragmentation,
            "sawicki_fragmentation" => self.sawicki_fragmentation,
            "num_allocs" => self.num_allocs,
            "num_frees" => self.num_frees,
            "num_ooms" => self.num_ooms,
            "max_allocations" => self.max_allocations,
        ]
    }
}

#[derive(Debug, Clone)]
pub struct MemPool {
    id: u64,
    capacity: u64,
    alignment: u64,
    policy: AlignmentPolicy,
    ranges: RangeAllocator,
    allocated_bytes: u64,
    allocated_bytes_peak: u64,
    requested_bytes: u64,
    reserved_bytes_peak: u64,
    num_allocs: u64,
    num_frees: u64,
    num_ooms: u64,
}

impl MemPool {
    pub fn new(
        capacity: u64,
        alignment: u64,
        policy: AlignmentPolicy,
        max_allocations: u32,
    ) -> CoreResult<Self> {
        ensure!(
            capacity != 0 && capacity <= MAX_CAPACITY,
            "capacity must be in [1, 2**48] bytes, got {capacity}"
        );
        ensure!(
            alignment.is_power_of_two(),
            "alignment must be a power of two, got {alignment}"
        );
        // Ascend's rule starts every allocation on a 64-byte boundary.
        let alignment = match policy {
            AlignmentPolicy::Default => alignment,
            AlignmentPolicy::Ascend => alignment.max(64),
        };
        ensure!(
            alignment <= capacity,
            "alignment {alignment} exceeds the capacity {capacity}"
        );
        ensure!(
            max_allocations != 0,
            "max_allocations must be in [1, 2**26], got 0",
        );
        ensure!(
            max_allocations <= MAX_ALLOCATIONS,
            "max_allocations must be in [1, 2**26], got {max_allocations} (its bookkeeping \
             would take {} bytes of host memory)",
            RangeAllocator::bytes_for(max_allocations).unwrap_or(u64::MAX)
        );
        let bytes = check_bookkeeping(RangeAllocator::bytes_for(max_allocations), || {
            format!("max_allocations = {max_allocations}")
        })?;
        let what = format!(
            "the bookkeeping of max_allocations = {max_allocations} ({bytes} bytes in all)"
        );
        let units = capacity / alignment;
        Ok(MemPool {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            capacity,
            alignment,
            policy,
            ranges: RangeAllocator::new(units, max_allocations, &what)?,
            allocated_bytes: 0,
            allocated_bytes_peak: 0,
            requested_bytes: 0,
            reserved_bytes_peak: units * alignment,
            num_allocs: 0,
            num_frees: 0,
            num_ooms: 0,
        })
    }

    /// Unique across every pool of the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    pub fn policy(&self) -> AlignmentPolicy {
        self.policy
    }

    /// Bytes a request of `size` takes, before rounding to the alignment.
    fn footprint(&self, size: u64) -> u64 {
        match self.policy {
            AlignmentPolicy::Default => size,
            AlignmentPolicy::Ascend => size.div_ceil(32) * 32 + 32,
        }
    }

    /// Bytes `malloc(size)` would take from the pool.
    pub fn rounded_size(&self, size: u64) -> u64 {
        self.footprint(size).div_ceil(self.alignment) * self.alignment
    }

    pub fn malloc(&mut self, size: u64) -> CoreResult<PoolAllocation> {
        ensure!(size != 0, "size must be at least 1 byte, got 0");
        let usable = self.ranges.capacity() * self.alignment;
        ensure!(
            size <= usable && self.rounded_size(size) <= usable,
            "size {size} exceeds the pool's capacity of {usable} bytes{}",
            if self.policy == AlignmentPolicy::Ascend {
                " (with Ascend's 32-byte padding)"
            } else {
                ""
            }
        );
        let units = self.rounded_size(size) / self.alignment;
        let mut result = self.ranges.allocate(units);
        let trimmed_end = self.ranges.end();
        if result == Err(AllocFailure::NoRange) && trimmed_end < self.ranges.capacity() {
            // Space given back by `trim_to` is taken again when needed (and given back again
            // if even that does not help, so a failed call changes nothing).
            self.ranges.set_end(self.ranges.capacity());
            result = self.ranges.allocate(units);
            match result {
                Ok(_) => {
                    self.reserved_bytes_peak = self.reserved_bytes_peak.max(self.reserved_bytes())
                }
                Err(_) => {
                    self.ranges.set_end(trimmed_end);
                }
            }
        }
        let range = match result {
            Ok(range) => range,
            Err(failure) => {
                self.num_ooms += 1;
                return Err(CoreError::PoolExhausted {
                    requested: size,
                    free: self.ranges.free_units() * self.alignment,
                    largest_free: self.ranges.largest_free() * self.alignment,
                    too_many_allocations: (failure == AllocFailure::TooManyAllocations)
                        .then_some(self.ranges.max_allocations()),
                });
            }
        };
        let offset = range.offset * self.alignment;
        let bytes = units * self.alignment;
        // Rounding adds less than alignment + 64 bytes, and alignment ≤ capacity ≤ 2**48 …
        // but a u32 holds the slack only below 4 GiB alignments; clamp (stats only).
        self.ranges
            .set_tag(range.node, u32::try_from(bytes - size).unwrap_or(u32::MAX));
        self.allocated_bytes += bytes;
        self.allocated_bytes_peak = self.allocated_bytes_peak.max(self.allocated_bytes);
        self.requested_bytes += size;
        self.num_allocs += 1;
        Ok(PoolAllocation {
            offset,
            size: bytes,
            pool_id: self.id,
            node: range.node,
            generation: range.generation,
        })
    }

    /// The allocation a handle names, if it is live and from this pool.
    pub fn get(&self, pool_id: u64, node: u32, generation: u32) -> CoreResult<PoolAllocation> {
        if pool_id != self.id {
            return Err(CoreError::InvalidHandle(
                "the allocation belongs to another pool".into(),
            ));
        }
        let range = self.ranges.get(node, generation).ok_or_else(|| {
            CoreError::InvalidHandle(
                "the allocation was already freed (double free or stale handle)".into(),
            )
        })?;
        Ok(PoolAllocation {
            offset: range.offset * self.alignment,
            size: range.size * self.alignment,
            pool_id,
            node,
            generation,
        })
    }

    /// Frees by handle.
    pub fn free(&mut self, pool_id: u64, node: u32, generation: u32) -> CoreResult<u64> {
        let allocation = self.get(pool_id, node, generation)?;
        self.release(node, generation);
        Ok(allocation.size)
    }

    /// Frees the allocation that starts at `offset`.
    pub fn free_offset(&mut self, offset: u64) -> CoreResult<u64> {
        let range = offset.is_multiple_of(self.alignment)
            .then(|| self.ranges.find_used_at(offset / self.alignment))
            .flatten()
            .ok_or_else(|| {
                CoreError::InvalidHandle(format!(
                    "no live allocation starts at offset {offset} (double free, or not from this pool)"
                ))
            })?;
        self.release(range.node, range.generation);
        Ok(range.size * self.alignment)
    }

    fn release(&mut self, node: u32, generation: u32) {
        let size = self
            .ranges
            .get(node, generation)
            .map_or(0, |range| range.size)
            * self.alignment;
        let requested = size - u64::from(self.ranges.tag(node)).min(size);
        if self.ranges.free(node, generation) {
            self.allocated_bytes -= size;
            self.requested_bytes -= requested;
            self.num_frees += 1;
        }
    }

    /// Frees every allocation; every outstanding handle becomes stale.
    pub fn reset(&mut self) {
        self.num_frees += self.ranges.num_used() as u64;
        self.ranges.reset();
        self.allocated_bytes = 0;
        self.requested_bytes = 0;
    }

    /// Gives back the free space at the end of the region beyond `min_bytes_to_keep` (or
    /// beyond the last live allocation, whichever is higher). Returns the bytes released. A
    /// later `malloc` that needs the space takes it back.
    pub fn trim_to(&mut self, min_bytes_to_keep: u64) -> u64 {
        let before = self.reserved_bytes();
        let keep = min_bytes_to_keep.div_ceil(self.alignment);
        if keep < self.ranges.end() {
            self.ranges.set_end(keep);
        }
        before - self.reserved_bytes()
    }

    /// Bytes the pool currently manages (the capacity, less what `trim_to` gave back).
    pub fn reserved_bytes(&self) -> u64 {
        self.ranges.end() * self.alignment
    }

    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes
    }

    pub fn num_allocations(&self) -> usize {
        self.ranges.num_used() as usize
    }

    /// Live allocations in address order: (offset, usable size, requested size).
    pub fn snapshot(&self) -> Vec<(u64, u64, u64)> {
        self.ranges
            .live_ranges()
            .into_iter()
            .map(|range| {
                let size = range.size * self.alignment;
                let requested = size - u64::from(self.ranges.tag(range.node)).min(size);
                (range.offset * self.alignment, size, requested)
            })
            .collect()
    }

    /// Free ranges in address order: (offset, size).
    pub fn free_ranges(&self) -> Vec<(u64, u64)> {
        self.ranges
            .ranges()
            .filter(|&(_, _, used)| !used)
            .map(|(offset, size, _)| (offset * self.alignment, size * self.alignment))
            .collect()
    }

    pub fn stats(&self) -> MemPoolStats {
        let free_bytes = self.ranges.free_units() * self.alignment;
        let largest_free = self.ranges.largest_free() * self.alignment;
        let alignment_squared = (self.alignment as f64).powi(2);
        let sum_of_squares = self.ranges.free_sum_of_squares() * alignment_squared;
        let (fragmentation, sawicki_fragmentation) = if free_bytes == 0 {
            (0.0, 0.0)
        } else {
            (
                1.0 - largest_free as f64 / free_bytes as f64,
                (1.0 - sum_of_squares.sqrt() / free_bytes as f64).max(0.0),
            )
        };
        MemPoolStats {
            capacity: self.capacity,
            alignment: self.alignment,
            policy: self.policy,
            allocated_bytes: self.allocated_bytes,
            allocated_bytes_peak: self.allocated_bytes_peak,
            requested_bytes: self.requested_bytes,
            reserved_bytes: self.reserved_bytes(),
            reserved_bytes_peak: self.reserved_bytes_peak,
            free_bytes,
            largest_free,
            fragmentation,
            sawicki_fragmentation,
            active_allocations: self.ranges.num_used() as u64,
            free_ranges: self.ranges.num_free_ranges() as u64,
            num_allocs: self.num_allocs,
            num_frees: self.num_frees,
            num_ooms: self.num_ooms,
            max_allocations: self.ranges.max_allocations() as u64,
        }
    }

    /// Host bytes of bookkeeping: the range allocator's node store and offset index.
    pub fn heap_bytes(&self) -> usize {
        self.ranges.heap_bytes()
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        self.ranges.check_invariants()?;
        let allocated: u64 = self
            .ranges
            .live_ranges()
            .iter()
            .map(|range| range.size * self.alignment)
            .sum();
        if allocated != self.allocated_bytes {
            return Err(format!(
                "{allocated} bytes live, counter says {}",
                self.allocated_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::fallible::MAX_BOOKKEEPING_BYTES;

    #[test]
    fn huge_max_allocations_is_refused_naming_it_and_the_bytes() {
        for max_allocations in [MAX_ALLOCATIONS + 1, u32::MAX] {
            let error =
                MemPool::new(4096, 64, AlignmentPolicy::Default, max_allocations).unwrap_err();
            let message = error.to_string();
            assert!(
                message.contains(&format!("got {max_allocations}")) && message.contains("bytes"),
                "{message}"
            );
        }
        let largest = RangeAllocator::bytes_for(MAX_ALLOCATIONS).unwrap();
        assert!(largest <= MAX_BOOKKEEPING_BYTES);
    }
}
