//! A prompt run start to end: admitted, its K/V marked computed, freed, so that its full
//! blocks stay cached for the next prompt.

use atb_mem_core::{BlockMove, KvCache, Tokens};

/// Runs `ids` as sequence `seq_id`; returns its prefix hit and the moves its admission
/// planned. The cache's invariants hold after it.
pub fn run_once(cache: &mut KvCache, seq_id: u64, ids: &[u32]) -> (usize, Vec<BlockMove>) {
    let hit = cache
        .alloc_sequence(seq_id, Tokens::Ids(ids), None)
        .unwrap();
    let mut moves = Vec::new();
    cache.take_moves(&mut moves);
    cache.mark_computed(seq_id, Some(ids.len())).unwrap();
    cache.free_sequence(seq_id).unwrap();
    cache.check_invariants().unwrap();
    (hit, moves)
}
