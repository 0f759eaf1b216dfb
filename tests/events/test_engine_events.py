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
    long_enough = [event for event in stored if len(event.token_ids) >= 8]
    assert long_enough, "no stored root block spans the shared prefix"  # no vacuous truth
    assert all(tuple(event.token_ids[:8]) == tuple(shared) for event in long_enough)


def test_a_hybrid_engines_events_name_every_groups_blocks() -> None:
    """Gemma 3 (sliding and full layers, KV-cache groups): a router replaying the events
    holds, per group, exactly the blocks the engine caches."""
    model, _ = model_pair("gemma3")
    recorder = Recorder()
    engine = Engine(model, num_blocks=40, block_size=4, kv_events=recorder)
    assert len(engine.kv_cache.groups) == 3
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, size=12).tolist()
    prompts = [shared + rng.integers(3, 256, size=5).tolist() for _ in range(4)]
    engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    router = Router()
    for batch in recorder.batches:
        router.replay(batch)
    stats = engine.kv_cache.stats()
    assert stats["blocks_used"] == 0 and stats["evictions"] > 0
    assert router.blocks["device"] == set()
    assert len(router.grouped["device"]) == stats["blocks_cached"] > 0
    assert {group for group, _ in router.grouped["device"]} == {0, 1, 2}


def test_an_engine_without_a_publisher_records_nothing() -> None:
    model, _ = model_pair("llama")
    engine = Engine(model, num_blocks=16, block_size=4)
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0))
    assert not engine.kv_cache.enable_kv_events
    assert engine.kv_cache.take_events() == []


def test_bad_arguments_are_refused_with_clear_errors() -> None:
    import pytest

    from atb_mem.events.dynamo import tokens_hashes
    from atb_mem.events.zmq_publisher import ZmqEventPublisher

    model, _ = model_pair("llama")
    with pytest.raises(TypeError, match="publish"):
        Engine(model, num_blocks=16, block_size=4, kv_events=object())  # type: ignore[arg-type]
    for size in (0, -2, 1.5, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            Engine(model, num_blocks=16, block_size=4,
                   tensor_parallel_size=size)  # type: ignore[arg-type]
    # Refused before the model was touched: it still serves, alone.
    engine = Engine(model, num_blocks=16, block_size=4)
    [output] = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2, temperature=0))
    assert len(output.outputs[0].token_ids) == 2
    with pytest.raises(TypeError, match="topic"):
        ZmqEventPublisher("tcp://127.0.0.1:*", topic=b"kv")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="data_parallel_rank"):
        ZmqEventPublisher("tcp://127.0.0.1:*", data_parallel_rank="0")  # type: ignore[arg-type]
    for block_size in (0, -1, 2.0):
        with pytest.raises(ValueError, match="block_size"):
            tokens_hashes([1, 2, 3, 4], block_size)  # type: ignore[arg-type]
