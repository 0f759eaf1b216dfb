"""``TierScheduler`` driven by a simulated vLLM and a simulated worker, where a block's bytes
are the K/V identities of the tokens it holds: ``(salt, tokens[:pos + 1])`` per slot. Random
prompts share prefixes; vLLM schedules them in random order, leaves some waiting after their
lookup, preempts, aborts, decodes; the stores lose blocks. Every step's ``TierMoves`` run in
the workers' order (host copies, host loads, store fetches, the forward, saves, puts), and
every load must bring exactly the K/V of the tokens it stands for."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atb_mem.integrations.vllm.scheduler import Scheduled, TierMoves, TierScheduler
from atb_mem.kv.tiers.store import block_key
from tests.integrations.vllm.fakes import FakeStore

BS = 4  # vLLM's block size
ID = "m-tp0"
VOCAB = 3  # few distinct tokens: prompts and outputs share prefixes often


def kv(salt: str | None, tokens: list[int], pos: int) -> tuple[Any, ...]:
    """The K/V of position ``pos``: it depends on every token up to it, and the salt."""
    return (salt, tuple(tokens[:pos + 1]))


@dataclass
class Req:
    tokens: list[int]
    salt: str | None
    max_new: int
    status: str = "waiting"  # waiting, remote (an asynchronous load), running
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    window: tuple[int, int] = (0, 0)  # the tokens the tiers serve at its last admission
    outputs: int = 0
    aborted: bool = False


class Sim:
    def __init__(self, data: Any, tiers: str) -> None:
        self.draw = data.draw
        stores = {"host": 0, "stores": 2}.get(tiers) or self.draw(st.integers(1, 2))
        self.stores = [FakeStore("DISK"), FakeStore("MOONCAKE")][:stores]
        host = {"host": [6, 12, 40], "stores": [0], "both": [3, 6]}[tiers]
        self.sched = TierScheduler(
            block_size=BS, hash_block_size=self.draw(st.sampled_from([1, 2, 4])),
            num_host_blocks=self.draw(st.sampled_from(host)),
            eviction_policy=self.draw(st.sampled_from(["lru", "lfu", "slru", "priority"])),
            stores=self.stores, identities=[ID])
        self.free_full = self.sched.index.num_free_blocks
        self.host: dict[int, tuple[Any, ...]] = {}
        self.vllm: dict[int, list[Any]] = {}
        self.owner: dict[int, tuple[str, int]] = {}
        self.free_blocks = list(range(1, 1000))
        self.reqs: dict[str, Req] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.inflight: list[tuple[str, list[tuple[int, int, int]]]] = []
        self.recved: dict[str, set[int]] = {}
        self.by_hash: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.bases = [self.draw(st.lists(st.integers(0, VOCAB - 1), max_size=20))
                      for _ in range(3)]
        self.count = 0
        self.history: list[list[int]] = []
        self.seen: Counter[str] = Counter()  # what the run reached

    # ---- vLLM's blocks ------------------------------------------------------------------

    def grow(self, req_id: str, tokens: int) -> list[int]:
        request, new = self.reqs[req_id], []
        while len(request.blocks) * BS < tokens:
            block = self.free_blocks.pop(0)
            self.vllm[block] = [("junk", block)] * BS
            self.owner[block] = (req_id, len(request.blocks))
            request.blocks.append(block)
            new.append(block)
        return new

    def free(self, request: Req) -> None:
        for block in request.blocks:
            del self.owner[block]
            self.free_blocks.append(block)  # its bytes stay, as on a device
        request.blocks = []

    def remove(self, req_id: str) -> None:
        self.free(self.reqs.pop(req_id))
        for queue in (self.waiting, self.running):
            if req_id in queue:
                queue.remove(req_id)
        self.recved.pop(req_id, None)

    # ---- requests come and go -----------------------------------------------------------

    def add(self) -> None:
        kind = self.draw(st.integers(0, 2)) if self.history else 0
        if kind == 0:  # a prompt sharing some prefix with others
            base = self.draw(st.sampled_from(self.bases))
            tokens = base[:self.draw(st.integers(0, len(base)))]
            tokens += self.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
        else:  # an earlier prompt again, or its next turn (its outputs and more)
            tokens = list(self.draw(st.sampled_from(self.history)))
            if kind == 2:
                tokens += self.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                             max_size=8))
        self.history.append(tokens)
        req_id = f"r{self.count}"
        self.count += 1
        self.reqs[req_id] = Req(tokens, self.draw(st.sampled_from([None, "s"])),
                                self.draw(st.integers(1, 6)))
        self.waiting.insert(self.draw(st.integers(0, len(self.waiting))), req_id)

    def abort(self) -> None:
        live = sorted(req_id for req_id, request in self.reqs.items() if not request.aborted)
        if not live:
            return
        req_id = self.draw(st.sampled_from(live))
        request = self.reqs[req_id]
        assert self.sched.finished(req_id) is False
        if request.status == "remote" and req_id not in self.recved:
            request.aborted = True  # vLLM frees its blocks once the load is reported
            self.seen["aborted loading"] += 1
            self.waiting.remove(req_id)
        else:
            self.remove(req_id)

    # ---- a step -------------------------------------------------------------------------

    def step(self) -> None:
        if self.draw(st.integers(0, 2)) == 0 or not self.reqs:
            self.add()
        if self.reqs and self.draw(st.integers(0, 9)) == 0:
            self.abort()
        scheduled, preempted = [], False
        for req_id in list(self.running):
            request = self.reqs[req_id]
            if self.draw(st.integers(0, 11)) == 0:  # preempted
                self.free(request)
                request.status, request.computed, preempted = "waiting", 0, True
                self.seen["preempted"] += 1
                self.running.remove(req_id)
                self.waiting.insert(0, req_id)
                continue
            count = min(len(request.tokens) - request.computed, self.chunk())
            new = self.grow(req_id, request.computed + count)
            scheduled.append(Scheduled(req_id, request.computed, count, new or None))
        if not preempted:
            scheduled += self.admit()
        moves = self.sched.build(scheduled, idle=not scheduled)
        self.execute(moves, scheduled)
        self.finish_loads()
        self.update(scheduled)

    def chunk(self) -> int:
        return self.draw(st.sampled_from([1, 2, 3, 5, 100]))

    def admit(self) -> list[Scheduled]:
        scheduled = []
        for req_id in list(self.waiting):
            request = self.reqs[req_id]
            if request.status == "remote":
                if req_id not in self.recved:
                    continue  # still loading
                failed = self.recved.pop(req_id)
                request.status = "waiting"
                request.computed = next((at * BS for at, block in enumerate(request.blocks)
                                         if block in failed), request.window[1])
                if not request.computed:
                    self.free(request)  # vLLM asks again
            if request.computed == 0:
                tokens = request.tokens
                local = self.draw(st.integers(0, (len(tokens) - 1) // BS)) * BS
                external, asynchronous = self.sched.lookup(req_id, tokens, local, request.salt)
                assert 0 <= external and local + external < len(tokens)
                assert not asynchronous or external > 0
                if self.draw(st.integers(0, 5)) == 0:
                    self.seen["not scheduled"] += 1
                    break  # vLLM could not allocate for it: it asks again next step
                done = local + external
                count = 0 if asynchronous else min(len(tokens) - done, self.chunk())
                self.grow(req_id, done + count)
                for pos in range(local):  # vLLM's own prefix cache
                    self.vllm[request.blocks[pos // BS]][pos % BS] = kv(request.salt, tokens,
                                                                         pos)
                self.sched.allocated(req_id, list(request.blocks), external)
                request.window = (local, done)
                if asynchronous:
                    request.status = "remote"
                    continue
                request.computed = done
            else:  # its asynchronous load ended
                if self.draw(st.integers(0, 5)) == 0:
                    break
                self.sched.allocated(req_id, list(request.blocks), 0)
                count = min(len(request.tokens) - request.computed, self.chunk())
                self.grow(req_id, request.computed + count)
            self.waiting.remove(req_id)
            self.running.append(req_id)
            request.status = "running"
            scheduled.append(Scheduled(req_id, request.computed, count, list(request.blocks),
                                       True))
        return scheduled

    # ---- the workers --------------------------------------------------------------------

    def check_load(self, block: int, content: tuple[Any, ...], tier: str) -> None:
        """A load into vLLM ``block``: its request's K/V at every position it serves."""
        req_id, index = self.owner[block]
        request = self.reqs[req_id]
        begin, end = request.window
        first, last = index * BS, min((index + 1) * BS, end)
        assert begin <= first < last, (block, request.window, index)
        for pos in range(first, last):
            assert content[pos - first] == kv(request.salt, request.tokens, pos), \
                f"{req_id} block {index} position {pos}: {content[pos - first]}"
        self.seen[tier if last - first == BS else f"{tier} partial"] += 1

    def execute(self, moves: TierMoves, scheduled: list[Scheduled]) -> None:
        copies = moves.host_copies
        assert len({dst for _, dst in copies}) == len(copies), "one copy per block per step"
        assert all(self.host.get(src) is not None for src, _ in copies), "copy of nothing"
        gathered = [self.host[src] for src, _ in copies]
        self.host.update((dst, content) for (_, dst), content in zip(copies, gathered,
                                                                     strict=True))
        for src, dst in moves.host_loads:
            assert self.host.get(src) is not None, f"host block {src} was never written"
            self.check_load(dst, self.host[src], "host")
            self.vllm[dst] = list(self.host[src])
        self.inflight += list(moves.store_loads.items())
        self.seen["host copy"] += len(copies)
        for row in scheduled:  # the forward reads what is computed, then writes the rest
            request = self.reqs[row.req_id]
            for pos in range(row.num_computed_tokens + row.num_scheduled_tokens):
                slot = self.vllm[request.blocks[pos // BS]]
                if pos < row.num_computed_tokens:
                    assert slot[pos % BS] == kv(request.salt, request.tokens, pos), \
                        f"{row.req_id} attends to wrong K/V at {pos}"
                else:
                    slot[pos % BS] = kv(request.salt, request.tokens, pos)
        rows = [row for _, row in moves.saves]
        assert len(set(rows)) == len(rows) and 0 not in rows
        for block, _ in moves.saves:
            req_id, index = self.owner[block]
            request = self.reqs[req_id]
            assert self.vllm[block] == [kv(request.salt, request.tokens, pos)
                                        for pos in range(index * BS, (index + 1) * BS)]
        saved = [tuple(self.vllm[block]) for block, _ in moves.saves]
        self.host.update(zip(rows, saved, strict=True))
        for request in self.reqs.values():
            hashes = self.sched.index.block_hashes(request.tokens, cache_salt=request.salt)
            for index, words in enumerate(hashes):
                content = tuple(kv(request.salt, request.tokens, pos)
                                for pos in range(index * BS, (index + 1) * BS))
                assert self.by_hash.setdefault((int(words[0]), int(words[1])),
                                               content) == content
        for from_host, block, high, low, names in moves.puts:
            content = self.host.get(block) if from_host else tuple(self.vllm[block])
            assert content is not None and content == self.by_hash[(high, low)]
            for store in self.stores:
                if store.name in names:
                    store.data[block_key(ID, (high, low))] = content
        for store in self.stores:  # a store loses a block
            if store.data and self.draw(st.integers(0, 3)) == 0:
                del store.data[self.draw(st.sampled_from(sorted(store.data)))]

    def finish_loads(self, every: bool = False) -> None:
        for entry in list(self.inflight):
            if not every and self.draw(st.booleans()):
                continue
            self.inflight.remove(entry)
            req_id, loads = entry
            if self.draw(st.integers(0, 3)) == 0:  # lost since the lookup
                _, _, gone = loads[self.draw(st.integers(0, len(loads) - 1))]
                key = block_key(ID, next((h, lo) for h, lo, b in loads if b == gone))
                for store in self.stores:
                    store.data.pop(key, None)
            failed: set[int] = set()
            for at, (high, low, block) in enumerate(loads):
                key = block_key(ID, (high, low))
                content = next((store.data[key] for store in self.stores
                                if key in store.data), None)
                if content is None:  # the rest is recomputed
                    self.seen["store failed"] += 1
                    failed = {block for _, _, block in loads[at:]}
                    break
                self.check_load(block, content, "store")
                self.vllm[block] = list(content)
            if self.reqs[req_id].aborted:
                self.remove(req_id)
            else:
                self.recved[req_id] = failed

    def update(self, scheduled: list[Scheduled]) -> None:
        for row in scheduled:
            request = self.reqs[row.req_id]
            request.computed += row.num_scheduled_tokens
            if request.computed == len(request.tokens):
                request.tokens.append(self.draw(st.integers(0, VOCAB - 1)))
                request.outputs += 1
                if request.outputs >= request.max_new:
                    assert self.sched.finished(row.req_id) is False
                    self.remove(row.req_id)

    def close(self) -> None:
        self.finish_loads(every=True)
        for req_id in list(self.reqs):
            assert self.sched.finished(req_id) is False
            self.remove(req_id)
        assert self.sched.num_requests == 0 and len(self.sched.index) == 0
        assert self.sched.index.num_free_blocks == self.free_full
        self.seen["host full"] += self.sched.counters["host_full"]
        self.execute(self.sched.build([]), [])  # what the last lookups left to copy


# What runs of each kind of tiers must reach, or they test too little.
REACHED = {"host": ("host", "host partial", "host copy", "not scheduled", "preempted"),
           "stores": ("store", "store failed"),
           "both": ("host", "store", "host full")}


@pytest.mark.parametrize("tiers", sorted(REACHED))
def test_every_load_brings_the_kv_of_its_tokens(tiers: str) -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def run(data: Any) -> None:
        sim = Sim(data, tiers)
        for _ in range(data.draw(st.integers(5, 40))):
            sim.step()
        sim.close()
        seen.update(sim.seen)

    run()
    for reached in REACHED[tiers]:
        assert seen[reached], f"no run reached: {reached}"
