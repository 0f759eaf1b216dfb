//! Prefix hits finer than a block (`hash_block_size`): a prompt sharing only the first
//! pieces of a cached block gets them by a copy into its own block, the cached block is
//! never written, and without `hash_block_size` nothing changes.

use atb_mem_core::{
    AttentionKind, BlockMove, CoreError, KvCache, KvCacheConfig, KvLayout, Medium, MoveKind, Tokens,
};

#[path = "support/run_once.rs"]
mod run_once;
use run_once::run_once;
#[path = "support/scheduler.rs"]
mod scheduler;
use scheduler::scheduler;

#[path = "support/pieces.rs"]
mod pieces;
use pieces::{cache, BLOCK_SIZE, PIECE};

fn cached_prompt() -> Vec<u32> {
    (0..20).collect() // blocks [0..8) and [8..16) full, 4 tokens in the third
}

/// `shared` leading tokens of the cached prompt, then tokens it never had.
fn sharing(shared: usize, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|t| if (t as usize) < shared { t } else { 1000 + t })
        .collect()
}

#[test]
fn a_prompt_sharing_part_of_a_block_copies_those_pieces() {
    let mut cache = cache(16, PIECE);
    run_once(&mut cache, 1, &cached_prompt());
    let cached = 2; // the cached prompt's second block (blocks go out in order)
                    // An ended sharer's last block holds the pieces it copied, and as the newer holder it
                    // serves them from then on (see `partial_tail_hits.rs`).
    let mut newest: Option<(usize, u32)> = None;
    for shared in [9, 10, 11, 13, 15] {
        let ids = sharing(shared, 24);
        let explained = cache.explain_prefix(&ids, None).unwrap();
        let expected = BLOCK_SIZE + (shared - BLOCK_SIZE) / PIECE * PIECE;
        assert_eq!(explained.hit_tokens, expected, "sharing {shared}");
        assert_eq!(explained.partial_tokens, expected - BLOCK_SIZE);
        assert_eq!(explained.tiers, [(Medium::Device, expected)]);
        let hit = cache.alloc_sequence(2, Tokens::Ids(&ids), None).unwrap();
        assert_eq!(hit, expected);
        assert_eq!(cache.num_computed(2).unwrap(), expected);
        let table = cache.block_table(2).unwrap().to_vec();
        assert_eq!(table[0], 1, "the whole block is shared");
        assert_ne!(table[1], cached, "the partly shared block is not");
        let partial = expected - BLOCK_SIZE;
        let source = match newest {
            Some((pieces, block)) if partial <= pieces => block,
            _ => cached,
        };
        let mut moves = Vec::new();
        cache.take_moves(&mut moves);
        let copy = BlockMove::new(MoveKind::Copy, source, table[1]);
        assert_eq!(moves, [copy][..usize::from(partial > 0)]);
        cache.check_invariants().unwrap();
        cache.free_sequence(2).unwrap();
        if partial > 0 {
            newest = Some((partial, table[1]));
        }
    }
    let stats = cache.stats();
    assert_eq!(
        stats.prefix_cache_partial_hit_tokens,
        (2 + 2 + 4 + 6) as u64
    );
}

#[test]
fn the_last_prompt_token_is_always_computed() {
    let mut cache = cache(16, PIECE);
    run_once(&mut cache, 1, &cached_prompt());
    // 12 tokens all cached: 8 + 2 pieces would reach the last token; one piece less.
    let hit = run_once(&mut cache, 2, &cached_prompt()[..12]).0;
    assert_eq!(hit, 10);
    // A first block partly shared (no whole block): copied from the first block.
    let (hit, moves) = run_once(&mut cache, 3, &sharing(5, 12));
    assert_eq!(hit, 4);
    assert_eq!(moves.len(), 1);
    assert_eq!(moves[0].src, 1);
}

#[test]
fn without_hash_block_size_hits_stay_whole_blocks() {
    let mut plain = cache(16, BLOCK_SIZE);
    assert_eq!(plain.hash_block_size(), BLOCK_SIZE);
    run_once(&mut plain, 1, &cached_prompt());
    let (hit, moves) = run_once(&mut plain, 2, &sharing(15, 24));
    assert_eq!((hit, moves.len()), (BLOCK_SIZE, 0));
    assert_eq!(plain.stats().prefix_cache_partial_hit_tokens, 0);
}

#[test]
fn an_evicted_source_is_no_longer_found() {
    // 4 usable blocks: the cached prompt's 3, then an unrelated prompt evicts them.
    let mut cache = cache(5, PIECE);
    run_once(&mut cache, 1, &cached_prompt());
    run_once(&mut cache, 2, &(500..532).collect::<Vec<u32>>());
    let explained = cache.explain_prefix(&sharing(13, 24), None).unwrap();
    assert_eq!((explained.hit_tokens, explained.partial_tokens), (0, 0));
    cache.check_invariants().unwrap();
}

#[test]
fn a_held_source_counts_in_the_budget_and_a_partial_hit_that_does_not_fit_is_given_up() {
    // The cached prompt's blocks are unused; a 24-token prompt needs 2 fresh blocks and its
    // whole-block hit, and holds its unused source while allocating: 4 free blocks.
    let mut cache = cache(8, PIECE); // 7 usable: 3 cached, 4 free
    run_once(&mut cache, 1, &cached_prompt());
    let ids = sharing(13, 24);
    // It takes and keeps 3 (the source goes back); with the source held, 4 must be free for
    // its partial hit.
    assert_eq!(
        cache.blocks_to_allocate(Tokens::Ids(&ids), None).unwrap(),
        3
    );
    // Hold 3 of the 7 blocks elsewhere: 4 left, 3 of them cached.
    cache
        .alloc_sequence(9, Tokens::Count(3 * BLOCK_SIZE), None)
        .unwrap();
    assert_eq!(cache.num_free_blocks(), 4);
    assert!(cache.can_allocate(Tokens::Ids(&ids), None).unwrap());
    let hit = cache.alloc_sequence(2, Tokens::Ids(&ids), None).unwrap();
    assert_eq!(hit, 12);
    let mut moves = Vec::new();
    cache.take_moves(&mut moves);
    let table = cache.block_table(2).unwrap().to_vec();
    // The copy reads the source before anything else writes it: the source is not among
    // the blocks the admission took.
    assert_eq!(moves, [BlockMove::new(MoveKind::Copy, 2, table[1])]);
    assert!(!table.contains(&2));
    cache.check_invariants().unwrap();
    cache.free_sequence(2).unwrap();
    // With 3 left the partial hit does not fit, the whole-block hit does: it is admitted
    // with that, and nothing is copied.
    cache.alloc_sequence(8, Tokens::Count(1), None).unwrap();
    assert_eq!(
        cache.blocks_to_allocate(Tokens::Ids(&ids), None).unwrap(),
        3
    );
    let explained = cache.explain_prefix(&ids, None).unwrap();
    assert_eq!(
        (explained.hit_tokens, explained.partial_tokens),
        (BLOCK_SIZE, 0)
    );
    let hit = cache.alloc_sequence(2, Tokens::Ids(&ids), None).unwrap();
    assert_eq!((hit, cache.num_pending_moves()), (BLOCK_SIZE, 0));
    cache.check_invariants().unwrap();
    cache.free_sequence(2).unwrap();
    // One block short even so: refused, and nothing changed.
    cache.alloc_sequence(7, Tokens::Count(1), None).unwrap();
    let state = |cache: &KvCache| {
        let tables: Vec<Vec<u32>> = [7, 8, 9]
            .map(|id| cache.block_table(id).unwrap().to_vec())
            .into();
        (
            format!("{:?}", cache.stats()),
            tables,
            cache.num_pending_moves(),
        )
    };
    let before = state(&cache);
    assert!(matches!(
        cache.alloc_sequence(2, Tokens::Ids(&ids), None),
        Err(CoreError::OutOfBlocks { .. })
    ));
    assert_eq!(before, state(&cache));
    cache.check_invariants().unwrap();
}

#[test]
fn bad_hash_block_sizes_are_refused() {
    let fresh = || KvCacheConfig::new(16, BLOCK_SIZE, KvLayout::default());
    for bad in [0, 3, 5, 16] {
        assert!(fresh().hash_block_size(bad).build().is_err(), "{bad}");
    }
    let off = fresh().prefix_caching(false).hash_block_size(PIECE);
    assert!(off.build().is_err());
    let layout = KvLayout {
        num_layers: 2,
        ..KvLayout::default()
    };
    let kinds = [
        AttentionKind::Full,
        AttentionKind::SlidingWindow { window: 4 },
    ];
    let hybrid = KvCacheConfig::new(16, BLOCK_SIZE, layout).layer_kinds(&kinds);
    let error = hybrid
        .hash_block_size(PIECE)
        .build()
        .unwrap_err()
        .to_string();
    assert!(error.contains("full-attention"), "{error}");
}

/// A prompt that needs every block is admitted by the scheduler (without its partial hit):
/// holding the source would need one block more than the cache has.
#[test]
fn the_scheduler_admits_a_prompt_that_fills_the_cache() {
    use atb_mem_core::StepPlan;
    let mut cache = cache(5, PIECE); // 4 usable
    run_once(&mut cache, 1, &cached_prompt());
    let mut scheduler = scheduler(&cache, 2, 64, 0.0);
    let ids = sharing(13, 4 * BLOCK_SIZE - 1);
    scheduler
        .add_request(&mut cache, 2, Tokens::Ids(&ids), 1, 1, 0, 0)
        .unwrap();
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 0, &mut plan).unwrap();
    assert_eq!(plan.prefill_seq_ids, [2]);
    assert_eq!(cache.num_computed(2).unwrap(), ids.len());
    assert!(plan.moves.is_empty());
    scheduler.check_invariants(&cache).unwrap();
}

/// The scheduler's watermark counts what an admission keeps, not the partial-hit source it
/// holds for a moment: a request that fits under the watermark runs, with its partial hit.
#[test]
fn the_watermark_does_not_count_a_held_source() {
    use atb_mem_core::StepPlan;
    let mut cache = KvCacheConfig::new(10, BLOCK_SIZE, KvLayout::default())
        .hash_block_size(PIECE)
        .build()
        .unwrap();
    run_once(&mut cache, 1, &cached_prompt()[..16]);
    let mut scheduler = scheduler(&cache, 4, 256, 0.1); // a watermark of one block of nine
                                                        // 63 tokens and the one it generates: all 8 blocks the watermark leaves. It shares the
                                                        // first 4 tokens of a cached block, whose source it holds while it allocates: 9.
    let ids = sharing(4, 8 * BLOCK_SIZE - 1);
    scheduler
        .add_request(&mut cache, 2, Tokens::Ids(&ids), 1, 1, 0, 0)
        .unwrap();
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 0, &mut plan).unwrap();
    assert_eq!(plan.prefill_seq_ids, [2]);
    assert_eq!(plan.moves.len(), 1, "with its partial hit's copy");
    scheduler.check_invariants(&cache).unwrap();
}
