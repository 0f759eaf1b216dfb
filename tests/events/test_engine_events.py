"""An ``Engine(kv_events=...)`` publishes each step's events: a router replaying them knows
the blocks the engine caches, named over the prompts' own tokens, and ``atb-mem serve``
takes the ZMQ endpoints."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from atb_mem.events import BlockStored, KVCacheEvent
from atb_mem.serving import Engine, SamplingParams
from tests.support.kv_event_workload import Router
from tests.support.models import model_pair


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[KVCacheEvent]] = []

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        self.batches.append(list(events))


def test_a_router_replaying_an_engines_events_knows_its_cached_blocks() -> None:
    model, _ = model_pair("llama")
    recorder = Recorder()
    engine = Engine(model, num_blocks=16, block_size=4, kv_events=recorder)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, size=8).tolist()
    prompts = [shared + rng.integers(3, 256, size=5).tolist() for _ in range(3)]
    # More tokens than the cache holds at once: the engine evicts along the way.
    engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    router = Router()
    for batch in recorder.batches:
        router.replay(batch)
    assert len(recorder.batches) > 1
    stats = engine.kv_cache.stats()
    assert stats["blocks_used"] == 0
    assert len(router.blocks["device"]) == stats["blocks_cached"] > 0
    stored = [event for batch in recorder.batches for event in batch
              if isinstance(event, BlockStored) and event.parent_block_hash is None]
    assert stored and all(tuple(event.token_ids[:8]) == tuple(shared) for event in stored
                          if len(event.token_ids) >= 8)


def test_an_engine_without_a_publisher_records_nothing() -> None:
    model, _ = model_pair("llama")
    engine = Engine(model, num_blocks=16, block_size=4)
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0))
    assert not engine.kv_cache.enable_kv_events
    assert engine.kv_cache.take_kv_events() == []
