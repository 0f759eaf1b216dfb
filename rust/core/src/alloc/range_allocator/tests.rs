//! Unit tests of the range allocator.

use super::bins::{bin_lower_bound, bin_round_down, bin_round_up};
use super::*;
use crate::error::CoreError;

#[test]
fn bins_bracket_sizes() {
    for size in (1..5000u64).chain([1 << 20, (1 << 40) + 12345, u64::MAX >> 2]) {
        let up = bin_round_up(size);
        let down = bin_round_down(size);
        assert!(bin_lower_bound(up) >= size, "size {size}");
        assert!(bin_lower_bound(down) <= size && down <= up);
        if down + 1 < NUM_BINS {
            assert!(bin_lower_bound(down + 1) > size);
        }
    }
}

#[test]
fn split_merge_and_stale_handles() {
    let mut ranges = RangeAllocator::new(100, 8, "test").unwrap();
    let a = ranges.allocate(10).unwrap();
    let b = ranges.allocate(20).unwrap();
    let c = ranges.allocate(30).unwrap();
    assert_eq!((a.offset, b.offset, c.offset), (0, 10, 30));
    assert_eq!(ranges.free_units(), 40);
    assert!(ranges.free(b.node, b.generation));
    assert!(!ranges.free(b.node, b.generation), "double free");
    assert_eq!(ranges.largest_free(), 40);
    assert!(ranges.free(a.node, a.generation));
    assert_eq!(
        ranges.ranges().collect::<Vec<_>>(),
        [(0, 30, false), (30, 30, true), (60, 40, false)]
    );
    assert!(ranges.free(c.node, c.generation));
    assert_eq!(ranges.ranges().collect::<Vec<_>>(), [(0, 100, false)]);
    ranges.check_invariants().unwrap();
    // The largest range is found even when it shares a bin with smaller ones.
    let d = ranges.allocate(100).unwrap();
    assert_eq!(ranges.allocate(1), Err(AllocFailure::NoRange));
    assert!(ranges.free(d.node, d.generation));
}

#[test]
fn exact_fit_in_a_coarse_bin() {
    // 1000 and 1001 share a bin; a request of 1001 must find the 1001-unit range.
    let mut ranges = RangeAllocator::new(1000 + 1 + 1001, 8, "test").unwrap();
    let a = ranges.allocate(1000).unwrap();
    let gap = ranges.allocate(1).unwrap();
    let b = ranges.allocate(1001).unwrap();
    ranges.free(a.node, a.generation);
    ranges.free(b.node, b.generation);
    let _ = gap;
    assert_eq!(ranges.allocate(1001).unwrap().offset, 1001);
    ranges.check_invariants().unwrap();
}

#[test]
fn trim_and_regrow_the_end() {
    let mut ranges = RangeAllocator::new(100, 4, "test").unwrap();
    let a = ranges.allocate(30).unwrap();
    assert_eq!(ranges.set_end(10), 30);
    assert_eq!(ranges.free_units(), 0);
    assert_eq!(ranges.allocate(1), Err(AllocFailure::NoRange));
    assert_eq!(ranges.set_end(100), 100);
    assert_eq!(ranges.free_units(), 70);
    ranges.free(a.node, a.generation);
    assert_eq!(ranges.set_end(0), 0);
    assert_eq!(ranges.ranges().count(), 0);
    ranges.check_invariants().unwrap();
    assert_eq!(ranges.set_end(100), 100);
    ranges.check_invariants().unwrap();
}

#[test]
fn node_store_limits_live_ranges() {
    let mut ranges = RangeAllocator::new(100, 2, "test").unwrap();
    let a = ranges.allocate(1).unwrap();
    ranges.allocate(1).unwrap();
    assert_eq!(ranges.allocate(1), Err(AllocFailure::TooManyAllocations));
    ranges.free(a.node, a.generation);
    ranges.allocate(1).unwrap();
    ranges.check_invariants().unwrap();
    ranges.reset();
    assert_eq!(ranges.get(a.node, a.generation), None);
    assert_eq!(ranges.free_units(), 100);
}

#[test]
fn huge_max_allocations_is_an_error_not_an_abort() {
    assert!(matches!(
        RangeAllocator::new(100, u32::MAX, "test"),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        RangeAllocator::new(100, NIL / 2, "test"),
        Err(CoreError::InvalidArgument(_))
    ));
    // 32 bytes a node, 8 index bytes a range (two 4-byte slots), 2 KiB of bins.
    assert_eq!(RangeAllocator::bytes_for(0), Some(32 + 64 + 2048));
    assert_eq!(
        RangeAllocator::bytes_for(1 << 26),
        Some(((1 << 27) + 1) * 32 + (1 << 29) + 2048)
    );
}
