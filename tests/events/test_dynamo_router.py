"""Our events in NVIDIA Dynamo's own indexer (``ai-dynamo-runtime``'s ``RadixTree``): the
router scores exactly the blocks our cache would serve a request from, through stores,
evictions, swaps and clears; between two engines it picks the one holding the prompt."""

from __future__ import annotations

import numpy as np
from dynamo._core import RadixTree, compute_block_hash_for_seq
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atb_mem import KVCachePool
from atb_mem.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from atb_mem.events.dynamo import encode_event, router_group, tokens_hashes
from atb_mem.serving import Engine, SamplingParams
from tests.events.test_engine_events import Recorder
from tests.support.kv_event_workload import apply as apply_operation
from tests.support.kv_event_workload import hybrid_operation, operation
from tests.support.models import model_pair

BLOCK_SIZE = 2


def apply(tree: RadixTree, worker: int, events: list[KVCacheEvent], group: int = 0) -> None:
    for event in events:
        payload = encode_event(event, group)
        if payload is not None:
            tree.apply_event(worker, payload)


def score(tree: RadixTree, worker: int, tokens: list[int], block_size: int) -> int:
    scores = tree.find_matches(compute_block_hash_for_seq(tokens, block_size)).scores
    return int(scores.get((worker, 0), 0))


def test_tokens_hashes_are_dynamos_and_the_json_is_fixed() -> None:
    tokens = [1, 2, 3, 4, 70_000, 5, 6]
    assert tokens_hashes(tokens, 2) == compute_block_hash_for_seq(tokens, 2)
    stored = BlockStored(4, (11, 22), 9, (1, 2, 3, 4), 2, "device", 0)
    assert encode_event(stored) == (
        b'{"event_id":4,"data":{"stored":{"parent_hash":9,"blocks":['
        b'{"block_hash":11,"tokens_hash":10773075109927122010},'
        b'{"block_hash":22,"tokens_hash":2662118915037317746}]}}}')
    assert encode_event(BlockRemoved(5, (22,), "device")) == \
        b'{"event_id":5,"data":{"removed":{"block_hashes":[22]}}}'
    assert encode_event(AllBlocksCleared(6)) == b'{"event_id":6,"data":"cleared"}'
    assert encode_event(BlockRemoved(7, (22,), "host")) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(operation, max_size=30), st.lists(st.integers(0, 2), min_size=3, max_size=9))
def test_the_router_scores_what_the_cache_would_serve(operations: list[tuple],
                                                       probe: list[int]) -> None:
    pool = KVCachePool(10, BLOCK_SIZE, device=None, enable_kv_events=True, num_host_blocks=4)
    tree = RadixTree()
    for step in operations:
        apply_operation(pool, step)
        apply(tree, 1, pool.take_events())
    routed = score(tree, 1, probe, BLOCK_SIZE)
    try:
        cached = pool.alloc_sequence(99, probe) // BLOCK_SIZE
    except MemoryError:
        return  # no room to ask the cache itself
    # The cache never serves a prompt's last token from the cache (it must be computed).
    full = (len(probe) - 1) // BLOCK_SIZE
    assert min(routed, full) == cached


@settings(max_examples=100, deadline=None)
@given(st.lists(hybrid_operation, max_size=40),
       st.lists(st.integers(0, 2), min_size=3, max_size=9))
# A reset once removed a freed sequence's blocks in block order, head before tail, and the
# tree could not remove a block whose parent it had removed.
@example(operations=[("alloc", 0, [0]), ("alloc", 1, [1]), ("decode", 0, 1), ("decode", 1, 3),
                     ("alloc", 0, [0]), ("free", 1), ("alloc", 0, [0]), ("reset",)],
         probe=[0, 0, 0])
def test_with_kv_cache_groups_the_router_follows_the_full_attention_group(
        operations: list[tuple], probe: list[int]) -> None:
    """Dynamo's tree has no groups: it follows the first full-attention group, and scores
    exactly that group's cached prefix — an upper bound of the hybrid hit (which also needs
    the sliding group's window), never below it."""
    pool = KVCachePool(24, BLOCK_SIZE, num_layers=3, device=None, enable_kv_events=True,
                       num_host_blocks=6, sliding_window=3,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    group = router_group(pool.groups)
    assert group == 1
    tree = RadixTree()
    for step in operations:
        apply_operation(pool, step)
        apply(tree, 1, pool.take_events(), group)
    routed = min(score(tree, 1, probe, BLOCK_SIZE), (len(probe) - 1) // BLOCK_SIZE)
    explained = pool.explain_prefix(probe)
    assert routed == explained.groups[group].cached_tokens // BLOCK_SIZE
    assert routed >= explained.hit_tokens // BLOCK_SIZE


def test_a_windows_evictions_do_not_hide_the_full_groups_prefix() -> None:
    """A decoding sequence's sliding group releases its first blocks; another request evicts
    them while the full group still holds the prompt: the router still scores the prompt
    (fed every group's events, it would drop the evicted hashes and score nothing)."""
    pool = KVCachePool(14, BLOCK_SIZE, num_layers=2, device=None, enable_kv_events=True,
                       sliding_window=2, layer_types=["sliding_attention", "full_attention"])
    tree = RadixTree()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    pool.alloc_sequence(1, prompt)
    pool.mark_computed(1)
    for _ in range(4):
        pool.append_tokens([1], token_ids=[9])
        pool.mark_computed(1)
    assert (pool.block_table(1, group=0)[:4] == 0).all()  # released by the window
    pool.alloc_sequence(2, [0] * 5)  # takes the free blocks: the released ones are evicted
    apply(tree, 1, pool.take_events(), router_group(pool.groups))
    assert pool.explain_prefix([*prompt, 0]).groups[1].cached_tokens == 8
    assert score(tree, 1, [*prompt, 0], BLOCK_SIZE) == 4


def test_between_two_engines_the_router_picks_the_one_with_the_prompt() -> None:
    model, _ = model_pair("llama")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=16).tolist() for _ in range(2)]
    tree = RadixTree()
    for worker, prompt in enumerate(prompts, start=1):
        recorder = Recorder()
        engine = Engine(model, num_blocks=32, block_size=4, kv_events=recorder)
        engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
        for batch in recorder.batches:
            apply(tree, worker, batch)
    for worker, prompt in enumerate(prompts, start=1):
        request = [*prompt, 7, 7, 7, 7]
        scores = tree.find_matches(compute_block_hash_for_seq(request, 4)).scores
        best = max(scores, key=scores.get)
        assert best == (worker, 0) and scores[best] == 4, scores
