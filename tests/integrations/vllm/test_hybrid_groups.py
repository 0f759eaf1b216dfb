"""``AtbMemConnector`` under vLLM's hybrid manager: a model's sliding-window and
full-attention layers form KV-cache groups, each with its own block ids over caches the
groups share (layer ``i`` of every group in cache ``i``). A block of a request is one vLLM
block per group, 0 where a window let the group's block go; the tiers keep one row per group
and move them together. Scheduler and worker here; vLLM itself in
``test_vllm_end_to_end.py``."""

from __future__ import annotations

import os
from typing import Any

import pytest

from atb_mem.integrations.vllm.moves import TierMoves
from atb_mem.integrations.vllm.scheduler import Scheduled
from tests.integrations.vllm.fakes import FakeStore
from tests.integrations.vllm.scheduler_calls import keys, make, prefill, words

if os.environ.get("ATB_MEM_REQUIRE_TORCH"):
    import torch  # CI: without torch these fail, never skip
else:
    torch = pytest.importorskip("torch")

GROUPS, NUM_BLOCKS, SHAPE = 3, 12, (2, 4, 16)


# ---- the scheduler side ------------------------------------------------------------------------

def test_a_hybrid_prompt_is_saved_per_group_and_loaded_where_the_groups_hold_blocks() -> None:
    sched = make()
    a = list(range(400))
    moves = prefill(sched, "a", a, [(1, 11, 21), (2, 12, 22), (3, 13, 23), (4, 14, 24)])
    assert [block for block, _ in moves.saves] == [(1, 11, 21), (2, 12, 22), (3, 13, 23)]
    sched.finished("a")
    # The repeat: the windowed groups let the first two blocks go (vLLM's null block, 0).
    blocks = [(5, 0, 0), (6, 0, 0), (7, 17, 27), (8, 18, 28)]
    assert sched.lookup("b", a, 0) == (384, False)
    sched.allocated("b", blocks, 384)
    moves = sched.build([Scheduled("b", 384, 16, blocks, True)])
    hosts = [host for _, host in prefill(make(), "x", a, [1, 2, 3, 4]).saves]
    assert moves.host_loads == list(zip(hosts, blocks[:3], strict=True))
    assert not moves.saves, "its blocks are in the host already"


def test_saves_stop_at_a_block_a_group_let_go_before_it_was_saved() -> None:
    """A hit needs every block before it: from a block no save can read whole (vLLM's own
    prefix cache served it, then a window let a group's copy go), nothing more is saved,
    and nothing of it is cached."""
    disk = FakeStore("DISK")
    sched = make(stores=[disk])
    a = list(range(520))
    blocks = [(1, 11), (2, 0), (3, 13), (4, 14), (5, 15)]
    assert sched.lookup("a", a, 0) == (0, False)
    sched.allocated("a", blocks, 0)
    moves = sched.build([Scheduled("a", 0, 400, blocks, True)])
    assert [block for block, _ in moves.saves] == [(1, 11)]
    assert [put[1] for put in moves.puts] == [moves.saves[0][1]]
    moves = sched.build([Scheduled("a", 400, 120, None)])  # the rest of the prompt
    assert not moves.saves and not moves.puts
    sched.finished("a")
    assert make(stores=[disk]).lookup("b", a, 0) == (0, False)
    assert sched.lookup("b", a, 0) == (128, False), "the block before it is cached"


def test_an_ended_hybrid_requests_tail_is_saved_only_while_every_group_holds_it() -> None:
    a = list(range(2000, 2300))  # two full blocks and 44 tokens: two whole pieces of 16
    for tail, saved in (((7, 17), True), ((7, 0), False)):
        sched = make(hash_block_size=16)
        prefill(sched, "a", a, [(5, 15), (6, 16), tail])
        assert sched.finished("a", 300) is saved, "vLLM holds the blocks of a tail"
        assert [block for _, block, _ in sched.build([]).tail_saves] == ([tail] if saved else [])


def test_a_model_of_windowed_layers_only_has_null_blocks_in_its_one_group() -> None:
    """vLLM keeps a model whose every layer is windowed (Mistral) as one group, whose blocks
    before the window are its null block 0: never saved, and once a save stopped there the
    host index grows no more for the request."""
    sched = make(num_host_blocks=16)
    a = list(range(900))
    assert sched.lookup("a", a, 0) == (0, False)
    blocks = [0, 0, 3, 4, 5, 6, 7, 8]  # vLLM's own cache served the first two blocks
    sched.allocated("a", blocks, 0)
    free = sched.index.num_free_blocks
    moves = sched.build([Scheduled("a", 256, 600, blocks, True)])
    assert not moves.saves and not moves.puts
    for step in range(3):  # decode steps that fill no new block save nothing either
        assert not sched.build([Scheduled("a", 856 + step, 1, None)]).saves
    assert sched.index.num_free_blocks >= free - 8, "no block held for what is never saved"


def test_a_failed_hybrid_load_takes_back_the_hosts_part_too() -> None:
    """vLLM recomputes a request whose load failed whole: the host blocks it loaded were
    not served either."""
    disk = FakeStore("DISK")
    sched = make(stores=[disk])
    a = list(range(520))
    prefill(sched, "a", a, [(1, 11), (2, 12), (3, 13), (4, 14), (5, 15)])
    sched.finished("a")
    b = a[:256] + list(range(5000, 5300))
    disk.data.update(dict.fromkeys(keys(sched, b)[2:4], b"x"))
    assert sched.lookup("b", b, 0) == (512, True)
    sched.allocated("b", [(6, 16), (7, 17), (8, 18), (9, 19), (10, 20)], 512)
    assert sched.take_counters().get("hit_tokens", 0) == 0, "not before its loads end"
    sched.loads_ended({"b"}, (), {"b"})
    assert sched.take_counters().get("hit_tokens", 0) == 0, "not the host's 256 either"
    assert sched.hit_tokens("b") == {}


def test_a_failed_hybrid_load_is_named_by_its_request_and_counts_nothing_served() -> None:
    """vLLM cannot map block ids back to requests with several groups: the workers name the
    request (``failed_recving``), vLLM recomputes it whole, and none of its load counts."""
    disk = FakeStore("DISK")
    a = list(range(520))
    sched = make(num_host_blocks=0, stores=[disk])
    disk.data.update(dict.fromkeys(keys(sched, a)[:3], b"x"))
    assert sched.lookup("a", a, 0) == (384, True)
    blocks = [(1, 0), (2, 12), (3, 13), (4, 14), (5, 15)]
    sched.allocated("a", blocks, 384)
    moves = sched.build([])
    assert moves.store_loads == {"a": [(*words(sched, a)[index], blocks[index])
                                       for index in range(3)]}
    sched.loads_ended({"a"}, (), {"a"})
    assert sched.take_counters().get("hit_tokens", 0) == 0
    assert sched.hit_tokens("a") == {}
    # The failed blocks are not offered again for a while.
    assert make(num_host_blocks=0, stores=[disk]).lookup("b", a, 0) == (384, True)
    assert sched.lookup("b", a, 0) == (0, False)


# ---- the worker side ---------------------------------------------------------------------------

def shared_caches(seed: int = 0) -> dict[str, Any]:
    """vLLM's CPU caches under the hybrid manager: two caches ([blocks, *block] each), each
    shared by one layer of every group (the same tensor under each name)."""
    generator = torch.Generator().manual_seed(seed)
    caches = [torch.randn((NUM_BLOCKS, *SHAPE), generator=generator) for _ in range(2)]
    return {f"model.layers.{group * 2 + cache}.self_attn": caches[cache]
            for group in range(GROUPS) for cache in range(2)}


def hybrid_worker(stores: list[Any] = ()) -> Any:  # type: ignore[assignment]
    from atb_mem.integrations.vllm.worker import TierWorker

    return TierWorker(num_host_blocks=6, stores=list(stores), layout="hyb", identity="hyb-tp0",
                      groups=GROUPS)


def test_the_worker_moves_each_groups_block_and_skips_the_ones_let_go() -> None:
    kv = shared_caches()
    distinct = list({id(cache): cache for cache in kv.values()}.values())
    tier = hybrid_worker()
    assert tier.register(kv, NUM_BLOCKS) == GROUPS * 2 * torch.finfo(torch.float32).bits // 8 \
        * SHAPE[0] * SHAPE[1] * SHAPE[2], "a row per group, each cache once"
    before = [cache.clone() for cache in distinct]
    tier.save(TierMoves(saves=[((1, 2, 3), 1), ((4, 5, 6), 2)]))
    tier.start_loads(TierMoves(host_loads=[(1, (7, 0, 8)), (2, (9, 10, 11))]))
    part = 2 * 4 * SHAPE[0] * SHAPE[1] * SHAPE[2]  # a group's part of a row: 2 fp32 caches
    assert tier.take_counters()["loaded_bytes"] == 5 * part, "not the part a window let go"
    for cache, old in zip(distinct, before, strict=True):
        assert torch.equal(cache[7], old[1]) and torch.equal(cache[8], old[3])
        assert torch.equal(cache[9], old[4]) and torch.equal(cache[10], old[5])
        assert torch.equal(cache[11], old[6])
        assert torch.equal(cache[0], old[0]), "vLLM's null block is never written"
        untouched = [1, 2, 3, 4, 5, 6]
        assert torch.equal(cache[untouched], old[untouched])


def test_a_failed_hybrid_load_names_its_request_not_blocks() -> None:
    tier = hybrid_worker([FakeStore("DISK")])  # holds nothing: every read misses
    tier.register(shared_caches(), NUM_BLOCKS)
    tier.start_loads(TierMoves(store_loads={"a": [(1, 2, (3, 0, 4))]}))
    done: set[str] = set()
    for _ in range(600):  # bounded: 30 s
        done |= tier.finished(0.05)
        if done:
            break
    assert done == {"a"}
    assert tier.failed_requests() == {"a"} and tier.load_errors() == set()
    assert tier.failed_requests() == set(), "reported once"


# ---- what names the blocks ---------------------------------------------------------------------

def _config(*groups: tuple[str, int | None, int, int]) -> tuple[Any, Any]:
    """vLLM's config objects as ``kv_layout`` reads them: groups of (spec class name,
    window, layers, page bytes)."""
    from types import SimpleNamespace as Space

    specs = [type(kind, (), dict(block_size=128, page_size_bytes=page, dtype="float32",
                                 num_kv_heads=2, head_size=32, sliding_window=window))()
             for kind, window, _, page in groups]
    kv_cache_config = Space(kv_cache_groups=[
        Space(kv_cache_spec=spec, layer_names=[f"l{at}" for at in range(layers)])
        for spec, (_, _, layers, _) in zip(specs, groups, strict=True)])
    model = Space(hf_config=Space(to_dict=lambda: {"model_type": "gemma3_text"}),
                  quantization=None)
    vllm_config = Space(model_config=model, parallel_config=Space(tensor_parallel_size=1),
                        device_config=Space(device_type="cpu"))
    return vllm_config, kv_cache_config


def test_a_hybrid_layout_is_named_by_its_groups_and_sized_a_row_per_group() -> None:
    from atb_mem.integrations.vllm.identity import kv_layout

    full = _config(("FullAttentionSpec", None, 3, 1024))
    hybrid = _config(("SlidingWindowSpec", 64, 2, 1024), ("FullAttentionSpec", None, 1, 1024))
    other = _config(("SlidingWindowSpec", 32, 2, 1024), ("FullAttentionSpec", None, 1, 1024))
    one, _, block_bytes, groups = kv_layout(*full, "w")
    assert (block_bytes, groups) == (3 * 1024, 1), "a cache per layer, one group"
    named, block_size, block_bytes, groups = kv_layout(*hybrid, "w")
    assert (block_size, block_bytes, groups) == (128, 2 * 2 * 1024, 2)
    assert len({one, named, kv_layout(*other, "w")[0]}) == 3, "the window is in the name"


@pytest.mark.parametrize("groups, message", [
    ((("SlidingWindowSpec", 64, 2, 1024), ("MambaSpec", None, 1, 1024)), "MambaSpec"),
    ((("SlidingWindowSpec", 64, 2, 1024), ("FullAttentionSpec", None, 1, 2048)), "alike")])
def test_groups_the_tiers_cannot_keep_are_refused_naming_them(
        groups: tuple[tuple[str, int | None, int, int], ...], message: str) -> None:
    from atb_mem.integrations.vllm.identity import kv_layout

    with pytest.raises(ValueError, match=message):
        kv_layout(*_config(*groups), "w")


def test_a_windowed_models_null_block_is_never_loaded_into_nor_reported() -> None:
    from atb_mem.integrations.vllm.worker import TierWorker

    generator = torch.Generator().manual_seed(1)
    kv = {f"layer.{at}": torch.randn((NUM_BLOCKS, *SHAPE), generator=generator)
          for at in range(2)}
    before = [cache.clone() for cache in kv.values()]
    tier = TierWorker(num_host_blocks=6, stores=[FakeStore("DISK")], layout="win",
                      identity="win-tp0")
    tier.register(kv, NUM_BLOCKS)
    tier.save(TierMoves(saves=[(4, 1), (5, 2)]))
    tier.start_loads(TierMoves(host_loads=[(1, 0), (2, 7)],
                               store_loads={"a": [(1, 2, 0), (3, 4, 8)]}))
    for _ in range(600):  # bounded: 30 s; the store holds neither block
        if tier.finished(0.05):
            break
    for cache, old in zip(kv.values(), before, strict=True):
        assert torch.equal(cache[0], old[0]) and torch.equal(cache[7], old[5])
    assert tier.load_errors() == {8}, "the null block is no block of the request's"
