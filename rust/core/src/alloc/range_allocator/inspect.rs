//! Reading the allocator whole: its ranges, the largest free one, fragmentation figures,
//! the bookkeeping's memory, and the invariants (for tests).

use super::bins::{bin_round_down, LEAF_BINS, NUM_TOP_BINS};
use super::{Node, Range, RangeAllocator, NIL};

impl RangeAllocator {
    /// Every range in address order: (offset, size, used).
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64, bool)> + '_ {
        let mut first = self.last_node;
        while first != NIL && self.nodes[first as usize].neighbor_prev != NIL {
            first = self.nodes[first as usize].neighbor_prev;
        }
        let mut cursor = first;
        std::iter::from_fn(move || {
            if cursor == NIL {
                return None;
            }
            let node = cursor;
            cursor = self.nodes[node as usize].neighbor_next;
            Some((
                self.nodes[node as usize].offset,
                self.size_of(node),
                self.nodes[node as usize].used(),
            ))
        })
    }

    /// Live ranges with their handles, in address order.
    pub fn live_ranges(&self) -> Vec<Range> {
        let mut live = Vec::with_capacity(self.num_used as usize);
        let mut node = self.last_node;
        while node != NIL {
            let entry = self.nodes[node as usize];
            if entry.used() {
                live.push(Range {
                    offset: entry.offset,
                    size: self.size_of(node),
                    node,
                    generation: entry.generation(),
                });
            }
            node = entry.neighbor_prev;
        }
        live.reverse();
        live
    }

    /// The largest free range, exactly: the highest non-empty bin, searched range by range.
    pub fn largest_free(&self) -> u64 {
        if self.top_mask == 0 {
            return 0;
        }
        let top = 63 - self.top_mask.leading_zeros() as usize;
        let bin = top * LEAF_BINS + 7 - self.leaf_masks[top].leading_zeros() as usize;
        let mut largest = 0;
        let mut node = self.bin_heads[bin];
        while node != NIL {
            largest = largest.max(self.size_of(node));
            node = self.nodes[node as usize].bin_next;
        }
        largest
    }

    /// Σ fᵢ² over free ranges (for Sawicki's fragmentation metric).
    pub fn free_sum_of_squares(&self) -> f64 {
        self.ranges()
            .filter(|&(_, _, used)| !used)
            .map(|(_, size, _)| (size as f64).powi(2))
            .sum()
    }

    /// Host bytes of the allocator's own bookkeeping.
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.bin_heads.capacity() * 4
            + self.used_index.heap_bytes()
    }

    /// Checks every structural invariant (for tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut expected_offset = 0;
        let mut previous_free = false;
        let (mut used, mut free_ranges, mut free_units) = (0, 0, 0);
        for (offset, size, is_used) in self.ranges() {
            if offset != expected_offset || size == 0 {
                return Err(format!(
                    "range at {offset} (size {size}) does not follow {expected_offset}"
                ));
            }
            if !is_used && previous_free {
                return Err(format!("two adjacent free ranges at {offset}"));
            }
            previous_free = !is_used;
            expected_offset = offset + size;
            if is_used {
                used += 1;
            } else {
                free_ranges += 1;
                free_units += size;
            }
        }
        if expected_offset != self.end {
            return Err(format!("ranges end at {expected_offset}, not {}", self.end));
        }
        let mut binned = 0;
        for (bin, &head) in self.bin_heads.iter().enumerate() {
            let (top, leaf) = (bin / LEAF_BINS, bin % LEAF_BINS);
            if (head != NIL) != (self.leaf_masks[top] & (1 << leaf) != 0) {
                return Err(format!("bin {bin} and its bitmap disagree"));
            }
            let mut node = head;
            while node != NIL {
                if self.nodes[node as usize].used() || bin_round_down(self.size_of(node)) != bin {
                    return Err(format!("node {node} is in the wrong bin {bin}"));
                }
                binned += 1;
                node = self.nodes[node as usize].bin_next;
            }
        }
        for top in 0..NUM_TOP_BINS {
            if (self.leaf_masks[top] != 0) != (self.top_mask & (1 << top) != 0) {
                return Err(format!("top bin {top} and its bitmap disagree"));
            }
        }
        if (used, free_ranges, free_units) != (self.num_used, self.num_free_ranges, self.free_units)
            || binned != free_ranges
        {
            return Err("range counters disagree with the ranges".into());
        }
        if self.used_index.len() != used as usize
            || self
                .live_ranges()
                .iter()
                .any(|range| self.find_used_at(range.offset) != Some(*range))
        {
            return Err("the index of used ranges disagrees with the ranges".into());
        }
        if self.num_spare as usize + (used + free_ranges) as usize != self.nodes.len() {
            return Err("node store leaks nodes".into());
        }
        Ok(())
    }
}
