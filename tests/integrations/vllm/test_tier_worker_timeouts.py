"""A worker's late loads: what arrived in time lands, and a load waiting for a fetch thread
is not late."""

from __future__ import annotations

import threading
from typing import Any

from atb_mem.integrations.vllm.moves import TierMoves
from atb_mem.kv.tiers.store import frame
from tests.integrations.vllm.fakes import FakeStore
from tests.integrations.vllm.test_tier_worker import HASHES, KEYS, NUM_BLOCKS, block, caches, worker


class SecondReadWaits(FakeStore):
    """The first read answers at once; every later one waits for ``gate``."""

    def __init__(self) -> None:
        super().__init__("MOONCAKE")
        self.gate = threading.Event()
        self.reads = 0

    def get(self, key: str) -> Any:
        self.reads += 1
        if self.reads > 1:
            self.gate.wait(30)
        return super().get(key)


def test_a_late_load_lands_the_blocks_that_arrived_in_time() -> None:
    kv = caches()
    store = SecondReadWaits()
    tier = worker([store], load_timeout_s=0.05)
    tier.register(kv, NUM_BLOCKS)
    payload = b"".join(block(kv, 1))  # block 1's bytes, expected in blocks 4 and 5
    for key in KEYS[:2]:
        store.data[key] = frame(payload, True, key)
    tier.start_loads(TierMoves(store_loads={"r": [(*HASHES[0], 4), (*HASHES[1], 5)]}))
    done: set[str] = set()
    for _ in range(100):  # bounded: the timeout is 0.05 s
        done |= tier.finished(0.01)
        if done:
            break
    assert done == {"r"}
    assert tier.load_errors() == {5}  # only the block still being read is recomputed
    assert b"".join(block(kv, 4)) == payload
    store.gate.set()
    tier.close()
