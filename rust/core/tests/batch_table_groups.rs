//! A batch table over a cache with KV-cache groups: after any sequence of appends, window
//! releases (`mark_computed`) and swaps (both shown from the next append on), forks
//! (copy-on-write on the next append), removals, sequences started over under the same id
//! and lazily admitted prompts, every row of every group's table, every slot and every
//! length is what the cache itself says; a failed append changes no buffer. In debug builds
//! the cache also checks that its window bounds never skip a release (`windows_stay`).

use atb_mem_core::{AttentionKind, BatchTable, KvCache, KvCacheConfig, KvLayout, Tokens, PAD_SLOT};
use proptest::prelude::*;

const MAX_SEQS: usize = 4;
const WIDTH: usize = 24;

#[derive(Debug, Clone)]
enum Op {
    Append,
    MarkComputed,
    Fork(usize),
    Remove(usize),
    StartOver(usize),
    /// Started over as a prompt admitted lazily: its windowed groups take blocks as the
    /// prompt is computed.
    Admit(usize, usize),
    /// Out to the host tier and back: every held block is a new one.
    SwapRoundTrip(usize),
}

fn kind() -> impl Strategy<Value = AttentionKind> {
    prop_oneof![
        Just(AttentionKind::Full),
        (1..9usize).prop_map(|window| AttentionKind::SlidingWindow { window }),
        (1..9usize).prop_map(|chunk| AttentionKind::ChunkedLocal { chunk }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::Append),
        3 => Just(Op::MarkComputed),
        1 => (0..MAX_SEQS).prop_map(Op::Fork),
        1 => (0..MAX_SEQS).prop_map(Op::Remove),
        1 => (0..MAX_SEQS).prop_map(Op::StartOver),
        1 => (0..MAX_SEQS, 1..12usize).prop_map(|(row, len)| Op::Admit(row, len)),
        1 => (0..MAX_SEQS).prop_map(Op::SwapRoundTrip),
    ]
}

/// What the buffers must hold, from the cache's own per-group lists.
fn check(cache: &KvCache, table: &BatchTable, last_slots: &[Vec<i32>]) {
    let groups = cache.num_groups();
    let block_size = cache.block_size();
    let seq_ids: Vec<u64> = table.seq_ids().collect();
    for group in 0..groups {
        for (row, row_slots) in last_slots
            .iter()
            .chain(std::iter::repeat(&Vec::new()))
            .take(MAX_SEQS)
            .enumerate()
        {
            let index = group * MAX_SEQS + row;
            let cells = &table.block_tables()[index * WIDTH..(index + 1) * WIDTH];
            let mut expected = [0; WIDTH];
            let mut slot = PAD_SLOT;
            if let Some(&seq_id) = seq_ids.get(row) {
                let blocks = cache.group_block_table(seq_id, group).unwrap();
                for (cell, &block) in expected.iter_mut().zip(blocks) {
                    *cell = block as i32;
                }
                slot = row_slots[group];
                if slot != PAD_SLOT {
                    // The slot of the newest token, where the list holds it now.
                    let position = cache.seq_len(seq_id).unwrap() - 1;
                    let block = blocks[position / block_size] as usize;
                    assert_eq!(slot, (block * block_size + position % block_size) as i32);
                }
            }
            assert_eq!(cells, &expected[..], "group {group}, row {row}");
            assert_eq!(
                table.slot_mapping()[index],
                slot,
                "group {group}, row {row}"
            );
        }
    }
    for row in 0..MAX_SEQS {
        let len = seq_ids.get(row).map_or(0, |&id| cache.seq_len(id).unwrap());
        assert_eq!(table.context_lens()[row], len as i32);
    }
}

/// Records the slots an append of one token to every row gave (the cache moves no bytes here:
/// the plan contract is not under test).
fn appended(cache: &mut KvCache, rows: &[u64], last_slots: &mut [Vec<i32>]) {
    cache.take_moves(&mut Vec::new());
    let block_size = cache.block_size();
    for (&seq_id, slots) in rows.iter().zip(last_slots) {
        let position = cache.seq_len(seq_id).unwrap() - 1;
        for (group, slot) in slots.iter_mut().enumerate() {
            let blocks = cache.group_block_table(seq_id, group).unwrap();
            *slot = match blocks[position / block_size] as usize {
                // A group still to take the prompt's blocks has no slot for it yet.
                0 => PAD_SLOT,
                block => (block * block_size + position % block_size) as i32,
            };
        }
    }
}

fn run(kinds: Vec<AttentionKind>, block_size: usize, ops: Vec<Op>) {
    let layout = KvLayout {
        num_layers: kinds.len(),
        ..KvLayout::default()
    };
    let mut cache = KvCacheConfig::new(160, block_size, layout)
        .layer_kinds(&kinds)
        .host_blocks(160)
        .build()
        .unwrap();
    let groups = cache.num_groups();
    let mut table = BatchTable::new(MAX_SEQS, WIDTH, groups).unwrap();
    // The slots the last append wrote per row and group (PAD_SLOT before any).
    let mut last_slots: Vec<Vec<i32>> = Vec::new();
    let mut next_id = 0u64;
    let mut token = 0u32;
    let mut stale_until_append = false;
    for _ in 0..2 {
        let ids: Vec<u32> = (0..3).map(|t| t % 2).collect();
        cache
            .alloc_sequence(next_id, Tokens::Ids(&ids), None)
            .unwrap();
        table.add(&cache, next_id).unwrap();
        last_slots.push(vec![PAD_SLOT; groups]);
        next_id += 1;
    }
    check(&cache, &table, &last_slots);
    for op in ops {
        let rows: Vec<u64> = table.seq_ids().collect();
        match op {
            Op::Append => {
                let ids: Vec<u32> = rows.iter().map(|_| token % 3).collect();
                token += 1;
                let before = (table.block_tables().to_vec(), table.slot_mapping().to_vec());
                if table.append_tokens(&mut cache, Some(&ids)).is_err() {
                    // Out of blocks or width: all-or-nothing.
                    assert_eq!(table.block_tables(), &before.0[..]);
                    assert_eq!(table.slot_mapping(), &before.1[..]);
                } else {
                    appended(&mut cache, &rows, &mut last_slots);
                    stale_until_append = false;
                }
            }
            Op::MarkComputed => {
                for &seq_id in &rows {
                    let len = cache.seq_len(seq_id).unwrap();
                    // Windows release what no later token reads (an append's budget aside).
                    let _ = cache.mark_computed(seq_id, Some(len));
                }
                // The table shows the releases from the next append on (before the model
                // reads it again): until then, rows need not match.
                stale_until_append = true;
            }
            Op::Fork(row) if row < rows.len() && rows.len() < MAX_SEQS => {
                cache.fork(rows[row], next_id).unwrap();
                table.add(&cache, next_id).unwrap();
                last_slots.push(vec![PAD_SLOT; groups]);
                next_id += 1;
            }
            Op::Remove(row) if row < rows.len() => {
                table.remove(rows[row]).unwrap();
                cache.free_sequence(rows[row]).unwrap();
                last_slots.swap_remove(row);
            }
            Op::StartOver(row) if row < rows.len() => {
                // The same id, a new (shorter) list: the row must not keep the old one.
                cache.free_sequence(rows[row]).unwrap();
                if cache
                    .alloc_sequence(rows[row], Tokens::Ids(&[2]), None)
                    .is_err()
                {
                    // Forks still hold the blocks it freed, and nothing else is free: it
                    // leaves the table.
                    table.remove(rows[row]).unwrap();
                    last_slots.swap_remove(row);
                    continue;
                }
                // The row holds the old list until the next append brings it up to date.
                if table.append_tokens(&mut cache, None).is_ok() {
                    appended(&mut cache, &rows, &mut last_slots);
                    stale_until_append = false;
                } else {
                    // Out of blocks or width: the row is added again to learn the new list.
                    table.remove(rows[row]).unwrap();
                    last_slots.swap_remove(row);
                    table.add(&cache, rows[row]).unwrap();
                    last_slots.push(vec![PAD_SLOT; groups]);
                }
            }
            Op::Admit(row, len) if row < rows.len() => {
                cache.free_sequence(rows[row]).unwrap();
                let ids: Vec<u32> = (0..len as u32).map(|t| t % 3).collect();
                if cache
                    .admit_sequence(rows[row], Tokens::Ids(&ids), None)
                    .is_err()
                {
                    cache
                        .alloc_sequence(rows[row], Tokens::Count(1), None)
                        .unwrap();
                }
                table.remove(rows[row]).unwrap();
                last_slots.swap_remove(row);
                table.add(&cache, rows[row]).unwrap();
                last_slots.push(vec![PAD_SLOT; groups]);
            }
            Op::SwapRoundTrip(row) if row < rows.len() => {
                if cache.swap_out(&[rows[row]]).is_err() {
                    continue; // the host tier is full
                }
                cache.take_moves(&mut Vec::new());
                if cache.swap_in(&[rows[row]]).is_err() {
                    // Blocks it shared with a fork need copies there is no room for.
                    table.remove(rows[row]).unwrap();
                    cache.free_sequence(rows[row]).unwrap();
                    last_slots.swap_remove(row);
                }
                cache.take_moves(&mut Vec::new());
                // The row shows the new blocks from the next append on.
                stale_until_append = true;
            }
            _ => continue,
        }
        cache.check_invariants().unwrap();
        if !stale_until_append {
            check(&cache, &table, &last_slots);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(200),
        ..ProptestConfig::default()
    })]

    #[test]
    fn rows_follow_every_groups_list(
        kinds in prop::collection::vec(kind(), 1..5),
        block_size in 1..5usize,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(kinds, block_size, ops);
    }
}

#[test]
fn a_table_for_another_number_of_groups_is_refused() {
    let sliding = AttentionKind::SlidingWindow { window: 4 };
    let layout = KvLayout {
        num_layers: 2,
        ..KvLayout::default()
    };
    let mut cache = KvCacheConfig::new(16, 2, layout)
        .layer_kinds(&[sliding, AttentionKind::Full])
        .build()
        .unwrap();
    cache.alloc_sequence(1, Tokens::Count(3), None).unwrap();
    let mut table = BatchTable::new(2, 4, 1).unwrap();
    let message = table.add(&cache, 1).unwrap_err().to_string();
    assert!(message.contains("1 group(s); the cache has 2"), "{message}");
    assert!(table.is_empty());
    assert!(table.append_tokens(&mut cache, None).is_err());
    assert!(BatchTable::new(2, 4, 0).is_err());
}
