"""Hits and the tiers below the host, under a model (greedy tokens equal HF's ``generate``, the
device's unused blocks poisoned before every step):

- a prompt that hits the device counts as seen by the disk tier, so a hot prompt reaches the
  disk and comes back from it after a flood evicts it from the device and the host;
- with a prefix's head on the device and its tail only on disk, the admission loads the tail
  after the device's head, as ``explain_prefix`` says it will;
- loads that fail in any way are counted, and a hit from any tier counts as a hit.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atb_mem.kv import MISS_REASONS
from atb_mem.kv.tiers import block_key
from atb_mem.serving import Engine, SamplingParams
from atb_mem.serving.kv_sizing import block_bytes, kv_cache_shape
from tests.support.models import hf_greedy, model_pair, run_poisoned

BLOCK_SIZE = 4
# Short answers: no block fills past the prompt, so a hit request computes no full block.
GREEDY = SamplingParams(max_tokens=2, temperature=0)
# 17 tokens: 4 full blocks before the last token, which is always computed.
HOT = np.random.default_rng(100).integers(3, 256, size=17).tolist()
FLOODS = [[np.random.default_rng(seed).integers(3, 256, size=17).tolist()
           for seed in range(first, first + 8)] for first in (0, 8)]


def framed_block(model: Any) -> int:
    """The bytes of one block's file on disk: its K/V and the frame's 16-byte header."""
    per_block, _ = block_bytes(BLOCK_SIZE, **kv_cache_shape(model))
    return int(per_block) + 16


def tiered_engine(model: Any, path: Path, disk_bytes: int = 16 << 20) -> Engine:
    """15 usable device blocks (three finished prompts' worth), a host tier of 8 blocks and a
    disk tier that writes on the second sighting."""
    per_block, _ = block_bytes(BLOCK_SIZE, **kv_cache_shape(model))
    return Engine(model, num_blocks=16, block_size=BLOCK_SIZE, max_num_seqs=1,
                  kv_offload={"host": 8 * per_block, "disk": (str(path), f"{disk_bytes}B")})


def run(engine: Engine, request_id: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = run_poisoned(engine, {0: [(request_id, prompt, GREEDY)]})[
        request_id][0][0]
    return tokens


def flood(engine: Engine, which: int = 0) -> None:
    """Prompts seen once each (never written to disk) until ``HOT`` is on neither the device
    nor the host."""
    for index, prompt in enumerate(FLOODS[which]):
        run(engine, f"flood-{which}-{index}", prompt)
    assert engine.kv_cache.explain_prefix(HOT).hit_tokens == 0


def test_a_prompt_hit_on_the_device_reaches_the_disk(tmp_path: Path) -> None:
    model, reference = model_pair("llama")
    engine = tiered_engine(model, tmp_path)
    expected = hf_greedy(reference, HOT, GREEDY.max_tokens)
    assert engine.tiers is not None
    assert run(engine, "hot-0", HOT) == expected  # computed: seen once
    assert run(engine, "hot-1", HOT) == expected  # a device hit: seen twice, written
    assert engine.kv_cache.stats()["prefix_cache_hit_tokens"] >= 4 * BLOCK_SIZE
    assert engine.tiers.wait_for_saves(60)
    assert engine.tiers.counters.saved_by_tier.get("DISK", 0) == 4
    flood(engine)
    before = engine.tiers.counters.loaded_blocks
    assert run(engine, "hot-2", HOT) == expected
    assert engine.tiers.counters.loaded_blocks - before == 4


def head_on_device_tail_on_disk(tmp_path: Path) -> tuple[Engine, list[int]]:
    """An engine whose disk keeps only ``HOT``'s last two blocks (room for two: it evicted
    the first two) and whose device keeps its first two (computed by a prompt that shares
    them); and HF's tokens for ``HOT``."""
    model, reference = model_pair("llama")
    engine = tiered_engine(model, tmp_path, disk_bytes=framed_block(model) * 5 // 2)
    assert engine.tiers is not None
    run(engine, "hot-0", HOT)
    flood(engine, 0)
    run(engine, "hot-1", HOT)  # computed again: written
    assert engine.tiers.wait_for_saves(60)
    flood(engine, 1)
    keys = [block_key(engine.tiers.identity, words)
            for words in engine.kv_cache.block_hashes(HOT)[:4]]
    assert engine.tiers.stores[0].exists(keys) == [False, False, True, True]
    run(engine, "head", HOT[:8] + FLOODS[0][0][8:])
    assert engine.kv_cache.explain_prefix(HOT).hit_tokens == 2 * BLOCK_SIZE
    return engine, hf_greedy(reference, HOT, GREEDY.max_tokens)


def test_the_tail_on_disk_is_loaded_after_the_head_on_the_device(tmp_path: Path) -> None:
    """The explanation names both tiers, and the admission loads the tail from disk."""
    engine, expected = head_on_device_tail_on_disk(tmp_path)
    assert engine.tiers is not None
    why = engine.tiers.explain_prefix(HOT)
    assert why.hit_tokens == 4 * BLOCK_SIZE, why
    assert why.tiers == [("device", 2 * BLOCK_SIZE), ("disk", 2 * BLOCK_SIZE)], why
    assert run(engine, "hot-2", HOT) == expected
    assert engine.tiers.counters.loaded_blocks == 2
    assert engine.scheduler.stats()["load_failures"] == 0


def test_a_head_evicted_before_the_admission_is_recomputed_without_io(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``HOT`` is offered with its head on the device, then waits behind prompts that evict
    the head from the device and the host. Its load then names blocks no store holds: it
    fails at once, with no read and no damaged block, and ``HOT`` is recomputed."""
    engine, expected = head_on_device_tail_on_disk(tmp_path)
    assert engine.tiers is not None
    store, reads = engine.tiers.stores[0], []
    get = store.get
    monkeypatch.setattr(store, "get", lambda key: reads.append(key) or get(key))
    arrivals = [(f"flood-{index}", prompt, GREEDY) for index, prompt in enumerate(FLOODS[1])]
    results = run_poisoned(engine, {0: [*arrivals, ("hot", HOT, GREEDY)]})
    assert results["hot"][0][0] == expected
    assert reads == [] and engine.tiers.counters.loaded_blocks == 0
    counters = engine.tiers.counters
    assert (counters.load_failures, counters.corrupt_blocks) == (1, 0)
    assert engine.scheduler.stats()["load_failures"] == 1


def test_loads_that_fail_in_any_way_are_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load late past ``load_timeout_s`` and one whose copy to the device raises are each
    recomputed (HF's tokens) and counted, in the counters and the metric."""
    from atb_mem.observability.metrics import AtbMemCollector
    from tests.observability.test_metrics import scrape

    model, reference = model_pair("llama")
    engine = tiered_engine(model, tmp_path)
    expected = hf_greedy(reference, HOT, GREEDY.max_tokens)
    assert engine.tiers is not None
    for index in range(2):  # computed twice: on disk
        run(engine, f"hot-{index}", HOT)
        flood(engine, index)
    assert engine.tiers.wait_for_saves(60)
    store = engine.tiers.stores[0]
    get, arrived = store.get, threading.Event()

    def late(key: str) -> bytes | None:
        arrived.wait(60)  # held until the load has been given up
        return get(key)

    monkeypatch.setattr(store, "get", late)
    monkeypatch.setattr(engine.tiers, "load_timeout_s", 0.0)
    assert run(engine, "late", HOT) == expected
    arrived.set()
    assert engine.tiers.counters.load_failures == 1
    monkeypatch.setattr(store, "get", get)
    monkeypatch.setattr(engine.tiers, "load_timeout_s", 30.0)
    flood(engine, 0)

    def raising(load: object) -> bool:
        raise RuntimeError("the device copy failed")

    monkeypatch.setattr(engine.tiers, "_land", raising)
    assert run(engine, "raising", HOT) == expected
    assert engine.tiers.counters.load_failures == 2
    assert engine.scheduler.stats()["load_failures"] == 2
    samples = scrape(AtbMemCollector(kv_cache=engine.kv_cache, tiers=engine.tiers))
    assert samples["atb_mem_kv_tier_load_failures_total"][()] == 2


def test_a_prompt_served_from_disk_is_a_hit(tmp_path: Path) -> None:
    """An engine whose disk holds all 64 tokens a 65-token prompt can hit (an earlier engine
    wrote them) serves them from disk: the metrics count 16 block hits of 16 lookups and no
    miss, and the hit tokens come from the disk; ``kv_cache.stats()`` says the same (it
    counted the prompt a miss, not_cached, with no hit)."""
    from atb_mem.observability.metrics import AtbMemCollector
    from tests.observability.test_metrics import scrape

    long = np.random.default_rng(200).integers(3, 256, size=65).tolist()
    other = np.random.default_rng(201).integers(3, 256, size=65).tolist()

    def disk_engine() -> Engine:
        model, _ = model_pair("llama")
        return Engine(model, num_blocks=20, block_size=BLOCK_SIZE, max_num_seqs=1,
                      kv_offload={"disk": (str(tmp_path), "16MiB")})

    writer = disk_engine()
    for index, prompt in enumerate((long, other, long)):  # computed twice: on disk
        run(writer, f"write-{index}", prompt)
    assert writer.tiers is not None and writer.tiers.wait_for_saves(60)
    writer.shutdown()
    _, reference = model_pair("llama")
    engine = disk_engine()
    assert run(engine, "long", long) == hf_greedy(reference, long, GREEDY.max_tokens)
    assert engine.tiers is not None and engine.tiers.counters.loaded_blocks == 16
    samples = scrape(AtbMemCollector(kv_cache=engine.kv_cache, tiers=engine.tiers))
    assert samples["atb_mem_kv_cache_prefix_cache_queries_total"][()] == 16
    assert samples["atb_mem_kv_cache_prefix_cache_hits_total"][()] == 16
    assert samples["atb_mem_kv_cache_prefix_cache_hit_ratio"][()] == 1.0
    misses = samples["atb_mem_kv_cache_prefix_cache_misses_total"]
    assert sum(misses.values()) == 0, misses
    assert samples["atb_mem_kv_cache_prefix_cache_hit_tokens_total"][
        (("tier", "DISK"),)] == 64
    stats = engine.kv_cache.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (16, 16)
    assert stats["prefix_cache_hit_rate"] == 1.0
    assert stats["prefix_cache_hit_tokens"] == stats["prefix_cache_disk_hit_tokens"] == 64
    assert stats["prefix_cache_store_hit_tokens"] == 0
    assert sum(stats[f"prefix_cache_misses_{reason}"] for reason in MISS_REASONS) == 0
