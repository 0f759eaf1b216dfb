"""Eight threads move real bytes through one KVCachePool, checked against a byte oracle.

Compound operations must be one transaction each: ``swap_out`` (plan, copy device→host,
free), ``swap_in``, ``apply_pending_copies`` and ``write_kv`` (pending copy-on-write moves,
then the scatter). Were any of them split — device blocks freed before their bytes were
copied out, or pending copies taken by one thread and executed later without the lock —
another thread could take those blocks and write its own tokens into them in between, or
write into a copy's destination before the copy lands, and some sequence's bytes would end
up wrong.

Every token position holds a value no other position holds: key channel 0 is the id of the
sequence that wrote it (a forked child keeps its parent's id for the inherited tokens),
channel 1 the position, channel 2 the layer, channel 3 the head; the value is ``-key - 1``.
Each thread owns its own sequences (disjoint ids), and only its own calls create, fork,
append to, swap or free them; it writes every token right after allocating or appending it
(``write_kv`` first executes the pending copy-on-write moves), so nobody moves its blocks
while it reads them back, and it checks them — from the device cache, or from the host tier
while swapped — after each of its calls, while the others keep running. OutOfMemoryError is
expected now and then and must change nothing.
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

import atb_mem

NUM_THREADS = 8
NUM_BLOCKS = 1024  # 1023 usable: tight enough that allocations, appends and swap-ins fail
NUM_HOST_BLOCKS = 384  # tight enough that swap-outs fail now and then
BLOCK_SIZE = 16
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 4  # the four channels of the oracle's encoding
STEPS = 600
RUN_SECONDS = 12.0
JOIN_SECONDS = 60.0
MAX_SEQS_PER_THREAD = 8
MAX_DEVICE_BLOCKS_PER_THREAD = 300  # 8 × 300 > 1023: threads compete for blocks
MAX_HOST_BLOCKS_PER_THREAD = 80
BIG = 4097  # tokens in one call above which the core releases the GIL
SEQ_ID_STRIDE = 1_000_000  # thread t owns ids t * stride + 1, ...; all exact in float32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def new_pool(num_blocks: int = NUM_BLOCKS, num_host_blocks: int = NUM_HOST_BLOCKS,
             ) -> atb_mem.KVCachePool:
    return atb_mem.KVCachePool(num_blocks, BLOCK_SIZE, num_layers=NUM_LAYERS,
                               num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype="float32",
                               num_host_blocks=num_host_blocks)


# ---- the oracle -------------------------------------------------------------------------------


def encode(origins: np.ndarray, positions: np.ndarray, layer: int,
           ) -> tuple[np.ndarray, np.ndarray]:
    """Key and value rows ``[n, heads, head_dim]`` of tokens at ``positions`` written by the
    sequences ``origins``, in ``layer``."""
    key = np.empty((len(origins), NUM_KV_HEADS, HEAD_DIM), np.float32)
    key[:, :, 0] = np.asarray(origins)[:, None]
    key[:, :, 1] = np.asarray(positions)[:, None]
    key[:, :, 2] = layer
    key[:, :, 3] = np.arange(1, NUM_KV_HEADS + 1)[None, :]
    return key, -key - 1


def check_bytes(kv: atb_mem.KVCachePool, seq_id: int, origins: np.ndarray, swapped: bool,
                seq_len: int | None = None) -> None:
    """Asserts that ``seq_id``'s tokens hold what the oracle says, read from the device cache
    or, while the sequence is swapped out, from the host tier at its host blocks.

    ``seq_len``: the sequence's length when it exceeds ``len(origins)`` (appended tokens not
    written yet: only the first ``len(origins)`` are checked)."""
    n = len(origins)
    seq_len = n if seq_len is None else seq_len
    assert kv.is_swapped(seq_id) == swapped, (seq_id, swapped)
    assert kv.seq_len(seq_id) == seq_len, (seq_id, kv.seq_len(seq_id), seq_len)
    blocks = kv.block_table(seq_id)
    assert len(blocks) == cdiv(seq_len, BLOCK_SIZE), (seq_id, blocks.tolist(), seq_len)
    if n == 0:
        return
    positions = np.arange(n)
    for layer in range(NUM_LAYERS):
        want_key, want_value = encode(origins, positions, layer)
        for half, want in ((0, want_key), (1, want_value)):
            if swapped:
                got = kv.host_kv_cache[layer, half, blocks]
            else:
                cache = kv.key_cache(layer) if half == 0 else kv.value_cache(layer)
                got = cache[blocks]
            got = got.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n]
            if not np.array_equal(got, want):
                bad = np.flatnonzero((got != want).any(axis=(1, 2)))
                pos = int(bad[0])
                where = "host" if swapped else "device"
                raise AssertionError(
                    f"sequence {seq_id} ({where}, blocks {blocks.tolist()[:8]}...): "
                    f"{len(bad)} wrong token(s) in layer {layer} {('key', 'value')[half]}; "
                    f"first at position {pos} (block {int(blocks[pos // BLOCK_SIZE])}): "
                    f"got {got[pos, 0].tolist()}, want {want[pos, 0].tolist()}"
                )


def write_tokens(kv: atb_mem.KVCachePool, slots: np.ndarray, origins: np.ndarray,
                 positions: np.ndarray) -> None:
    """Writes the oracle's rows for these tokens into their slots, every layer."""
    for layer in range(NUM_LAYERS):
        key, value = encode(origins, positions, layer)
        kv.write_kv(layer, slots, key, value)


@dataclass
class Seq:
    origins: np.ndarray  # per position: the id of the sequence whose write it holds
    swapped: bool = False


# ---- the workers ------------------------------------------------------------------------------


class Worker:
    def __init__(self, kv: atb_mem.KVCachePool, tid: int, barrier: threading.Barrier) -> None:
        self.kv = kv
        self.tid = tid
        self.barrier = barrier
        self.rng = random.Random(77_000 + tid)
        self.ids = itertools.count(tid * SEQ_ID_STRIDE + 1)
        self.live: dict[int, Seq] = {}
        self.counts: Counter[str] = Counter()
        self.error: str | None = None

    # ------------------------------------------------------------- helpers

    def check(self, seq_id: int) -> None:
        seq = self.live[seq_id]
        check_bytes(self.kv, seq_id, seq.origins, seq.swapped)
        self.counts["checked"] += 1

    def check_all(self) -> None:
        for seq_id in self.live:
            self.check(seq_id)

    def own_state(self) -> dict[int, tuple[int, bool, list[int]]]:
        kv = self.kv
        return {i: (kv.seq_len(i), kv.is_swapped(i), kv.block_table(i).tolist())
                for i in self.live}

    def unchanged_after_failure(self, before: dict[int, tuple[int, bool, list[int]]]) -> None:
        """A call that raised changed nothing of this thread's: tables and bytes."""
        assert self.own_state() == before
        self.check_all()

    def on_device(self) -> list[int]:
        return [i for i, s in self.live.items() if not s.swapped]

    def swapped(self) -> list[int]:
        return [i for i, s in self.live.items() if s.swapped]

    def blocks_of(self, ids: list[int]) -> int:
        return sum(cdiv(len(self.live[i].origins), BLOCK_SIZE) for i in ids)

    def pick(self, ids: list[int], most: int) -> list[int]:
        ids = list(ids)
        self.rng.shuffle(ids)
        return ids[: self.rng.randint(1, min(most, len(ids)))]

    # ------------------------------------------------------------- operations

    def alloc(self, n: int) -> None:
        seq_id = next(self.ids)
        before = self.own_state()
        try:
            cached = self.kv.alloc_sequence(seq_id, n)  # a count: no prefix sharing
        except atb_mem.OutOfMemoryError:
            self.counts["oom alloc"] += 1
            assert seq_id not in self.kv
            self.unchanged_after_failure(before)
            return
        assert cached == 0
        self.counts["alloc"] += 1
        slots = self.kv.slot_mapping([seq_id], [0], [n])
        assert slots.shape == (n,)
        origins = np.full(n, seq_id, np.int64)
        write_tokens(self.kv, slots, origins, np.arange(n))
        self.counts["write_kv"] += 1
        self.live[seq_id] = Seq(origins)
        self.check(seq_id)

    def append(self, seq_ids: list[int], n: int) -> None:
        before = self.own_state()
        try:
            slots = self.kv.append_tokens(seq_ids, n)
        except atb_mem.OutOfMemoryError:
            self.counts["oom append"] += 1
            self.unchanged_after_failure(before)
            return
        self.counts["append"] += 1
        assert slots.shape == (len(seq_ids) * n,)
        starts = [len(self.live[i].origins) for i in seq_ids]
        ends = [s + n for s in starts]
        assert self.kv.slot_mapping(seq_ids, starts, ends).tolist() == slots.tolist()
        origins = np.repeat(np.array(seq_ids, np.int64), n)
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        choice = self.rng.random()
        if choice < 0.3:
            # Execute the recorded copy-on-write moves now: once this returns they have
            # landed, whichever thread executed them, so the inherited tokens must be there.
            self.kv.apply_pending_copies()
            self.counts["apply"] += 1
            for seq_id, end in zip(seq_ids, ends, strict=True):
                seq = self.live[seq_id]
                check_bytes(self.kv, seq_id, seq.origins, seq.swapped, seq_len=end)
        elif choice < 0.6:
            time.sleep(0)  # "the forward pass": let the other threads run in between
        # Executes the moves still pending, then scatters: one transaction, so no other
        # thread's copy can land on the new tokens afterwards.
        write_tokens(self.kv, slots, origins, positions)
        self.counts["write_kv"] += 1
        for seq_id in seq_ids:
            seq = self.live[seq_id]
            seq.origins = np.concatenate([seq.origins, np.full(n, seq_id, np.int64)])
            self.check(seq_id)

    def fork(self, parent: int) -> None:
        child = next(self.ids)
        self.kv.fork(parent, child)
        self.counts["fork"] += 1
        self.live[child] = Seq(self.live[parent].origins.copy())
        assert self.kv.block_table(child).tolist() == self.kv.block_table(parent).tolist()
        self.check(child)
        # Diverge at once now and then, so that shared partly filled blocks get copied.
        if self.rng.random() < 0.7:
            self.append([child] if self.rng.random() < 0.5 else [child, parent],
                        self.rng.randint(1, 3))

    def swap_out(self, seq_ids: list[int]) -> None:
        before = self.own_state()
        try:
            pairs = self.kv.swap_out(seq_ids)
        except atb_mem.OutOfMemoryError:
            self.counts["oom swap_out"] += 1
            self.unchanged_after_failure(before)
            return
        self.counts["swap_out"] += 1
        assert pairs.ndim == 2 and pairs.shape[1] == 2
        for seq_id in seq_ids:
            self.live[seq_id].swapped = True
            self.check(seq_id)

    def swap_in(self, seq_ids: list[int]) -> None:
        before = self.own_state()
        try:
            pairs = self.kv.swap_in(seq_ids)
        except atb_mem.OutOfMemoryError:
            self.counts["oom swap_in"] += 1
            self.unchanged_after_failure(before)
            return
        self.counts["swap_in"] += 1
        assert pairs.ndim == 2 and pairs.shape[1] == 2
        for seq_id in seq_ids:
            self.live[seq_id].swapped = False
            self.check(seq_id)

    def free(self, seq_id: int) -> None:
        self.kv.free_sequence(seq_id)
        self.counts["free"] += 1
        del self.live[seq_id]
        assert seq_id not in self.kv

    def wrong_state(self) -> None:
        """Calls that are wrong for a sequence's state raise ValueError and change nothing."""
        before = self.own_state()
        device, swapped = self.on_device(), self.swapped()
        kv = self.kv
        calls = []
        if device:
            on = self.rng.choice(device)
            calls.append(lambda: kv.swap_in([on]))
        if swapped:
            off = self.rng.choice(swapped)
            calls += [lambda: kv.swap_out([off]),
                      lambda: kv.append_tokens([off], 1),
                      lambda: kv.slot_mapping([off], [0], [1]),
                      lambda: kv.fork(off, next(self.ids))]
        if not calls:
            return
        with pytest.raises(ValueError):
            self.rng.choice(calls)()
        self.counts["wrong state"] += 1
        self.unchanged_after_failure(before)

    # ---------------------------------------------------------------- loop

    def step(self, step: int) -> None:
        rng = self.rng
        op = rng.choices(
            ["alloc", "alloc_big", "append", "append_big", "fork", "swap_out", "swap_in",
             "apply", "free", "check", "wrong_state"],
            weights=[10, 1, 14, 1, 8, 10, 10, 6, 5, 3, 2],
        )[0]  # fmt: skip
        device, swapped = self.on_device(), self.swapped()
        if op.startswith("alloc") and len(self.live) >= MAX_SEQS_PER_THREAD:
            op = "free"
        if op in ("append", "append_big", "fork", "swap_out") and not device:
            op = "swap_in" if swapped else "alloc"
        if op == "swap_in" and not swapped:
            op = "swap_out" if device else "alloc"
        if op == "free" and not self.live:
            op = "alloc"
        self.counts["op " + op] += 1

        if op == "alloc":
            self.alloc(rng.randint(1, 120))
        elif op == "alloc_big":  # append and write > 4096 tokens at once: GIL released
            self.alloc(rng.randint(BIG, BIG + 200))
        elif op == "append":
            self.append(self.pick(device, 3), rng.randint(1, 20))
        elif op == "append_big":
            ids = self.pick(device, 2)
            self.append(ids, BIG // len(ids) + 1)
        elif op == "fork":
            self.fork(rng.choice(device))
        elif op == "swap_out":
            self.swap_out(self.pick(device, 2))
        elif op == "swap_in":
            self.swap_in(self.pick(swapped, 2))
        elif op == "apply":
            # Executes whatever another thread has pending (it is about to write it anyway):
            # the copies must land exactly once and before that thread's write.
            self.kv.apply_pending_copies()
            self.counts["apply"] += 1
        elif op == "free":
            self.free(rng.choice(list(self.live)))
        elif op == "check":
            self.check_all()
            stats = self.kv.stats()
            assert stats["blocks_used"] + stats["blocks_free"] + stats["blocks_cached"] == (
                NUM_BLOCKS - 1
            )
            assert 0 <= stats["host_blocks_used"] <= NUM_HOST_BLOCKS
        else:
            self.wrong_state()

        # Keep each thread's share bounded: free the longest sequence of a full tier.
        while self.blocks_of(self.on_device()) > MAX_DEVICE_BLOCKS_PER_THREAD:
            self.free(max(self.on_device(), key=lambda i: len(self.live[i].origins)))
        while self.blocks_of(self.swapped()) > MAX_HOST_BLOCKS_PER_THREAD:
            self.free(max(self.swapped(), key=lambda i: len(self.live[i].origins)))
        if step % 10 == 0:
            self.check_all()
        if self.tid == 0 and step % 5 == 0:
            self.kv._check_invariants()
            self.counts["invariant checks"] += 1

    def run(self) -> None:
        try:
            self.barrier.wait(timeout=JOIN_SECONDS)  # all start together
            deadline = time.monotonic() + RUN_SECONDS
            for step in range(STEPS):
                if time.monotonic() > deadline:
                    break
                self.step(step)
                self.counts["steps"] += 1
        except BaseException:
            self.error = f"thread {self.tid}:\n{traceback.format_exc()}"
            self.barrier.abort()


# ---- the tests --------------------------------------------------------------------------------


@pytest.fixture
def fast_thread_switching() -> Iterator[None]:
    """Switches threads every 50 µs rather than every 5 ms, so that they interleave within
    each other's compound operations far more often."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.usefixtures("fast_thread_switching")
def test_eight_threads_move_bytes_atomically() -> None:
    kv = new_pool()
    barrier = threading.Barrier(NUM_THREADS)
    workers = [Worker(kv, tid, barrier) for tid in range(NUM_THREADS)]
    threads = [threading.Thread(target=w.run, name=f"kv-bytes-{w.tid}", daemon=True)
               for w in workers]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_SECONDS
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"worker(s) hung (deadlock?): {hung}"
    errors = [w.error for w in workers if w.error]
    assert not errors, "\n".join(errors)

    totals: Counter[str] = Counter()
    for w in workers:
        totals.update(w.counts)
    print(dict(sorted(totals.items())))
    # The run did what it is meant to: every kind of call succeeded many times, the large
    # GIL-free calls ran, and the pool was tight enough that calls failed for lack of room.
    for op in ("alloc", "append", "write_kv", "fork", "swap_out", "swap_in", "apply", "free",
               "wrong state", "op alloc_big", "op append_big", "invariant checks"):
        assert totals[op] > 0, (op, dict(totals))
    assert sum(v for k, v in totals.items() if k.startswith("oom ")) > 0, dict(totals)

    # Nothing pending is left (every append was followed by its write), and the pool agrees
    # with the oracle about every sequence, its tier and its bytes.
    kv._check_invariants()
    live = {i: s for w in workers for i, s in w.live.items()}
    assert kv.seq_ids() == sorted(live)
    for seq_id, seq in live.items():
        check_bytes(kv, seq_id, seq.origins, seq.swapped)
    stats = kv.stats()
    device = {b for i, s in live.items() if not s.swapped for b in kv.block_table(i).tolist()}
    host = {b for i, s in live.items() if s.swapped for b in kv.block_table(i).tolist()}
    assert stats["pending_copies"] == 0
    assert stats["num_sequences"] == len(live)
    assert stats["num_swapped"] == sum(s.swapped for s in live.values())
    assert stats["num_tokens"] == sum(len(s.origins) for s in live.values())
    assert stats["blocks_used"] == len(device)
    assert stats["blocks_used"] + stats["blocks_free"] + stats["blocks_cached"] == NUM_BLOCKS - 1
    assert stats["host_blocks_used"] == len(host)
    assert kv.num_free_host_blocks == NUM_HOST_BLOCKS - len(host)

    # Bring everything back: free the device sequences, swap the others in, check, free.
    for seq_id in [i for i, s in live.items() if not s.swapped]:
        kv.free_sequence(seq_id)
    for seq_id, seq in live.items():
        if seq.swapped:
            kv.swap_in([seq_id])
            check_bytes(kv, seq_id, seq.origins, swapped=False)
    for seq_id, seq in live.items():
        if seq.swapped:
            check_bytes(kv, seq_id, seq.origins, swapped=False)  # nothing overwrote them
            kv.free_sequence(seq_id)
    kv._check_invariants()
    stats = kv.stats()
    assert len(kv) == 0 and stats["blocks_used"] == 0 and stats["host_blocks_used"] == 0
    assert kv.num_free_blocks == NUM_BLOCKS - 1
    assert kv.num_free_host_blocks == NUM_HOST_BLOCKS


def test_byte_check_is_not_vacuous() -> None:
    """The oracle check catches a wrong byte on the device and in the host tier, a swap whose
    bytes never moved, and a copy-on-write copy that was dropped."""
    kv = new_pool(num_blocks=16, num_host_blocks=8)
    worker = Worker(kv, 0, threading.Barrier(1))
    worker.alloc(2 * BLOCK_SIZE + 5)
    (parent,) = worker.live
    worker.check_all()

    # One value on the device, key then value.
    for cache in (kv.key_cache(1), kv.value_cache(0)):
        block = int(kv.block_table(parent)[1])
        saved = float(cache[block, 3, 1, 2])
        cache[block, 3, 1, 2] += 1
        with pytest.raises(AssertionError, match=f"sequence {parent} .*position {BLOCK_SIZE + 3}"):
            worker.check(parent)
        cache[block, 3, 1, 2] = saved
        worker.check(parent)

    # One value in the host tier, while swapped out.
    worker.swap_out([parent])
    host_block = int(kv.block_table(parent)[2])
    kv.host_kv_cache[0, 0, host_block, 4, 0, 0] = 0
    with pytest.raises(AssertionError, match="host"):
        worker.check(parent)
    kv.host_kv_cache[0, 0, host_block, 4, 0, 0] = parent
    worker.check(parent)
    worker.swap_in([parent])

    # A swap-out whose bytes were never copied (what a lost transfer leaves behind).
    kv.swap_out([parent], execute=lambda moves: None)
    worker.live[parent].swapped = True
    with pytest.raises(AssertionError, match="host"):
        worker.check(parent)
    kv.free_sequence(parent)
    del worker.live[parent]

    # A copy-on-write copy taken and never executed (what two racing applies could lose):
    # the child's new token is written, but its inherited tokens in the copied block are not.
    worker.alloc(BLOCK_SIZE + 5)
    (parent,) = worker.live
    child = next(worker.ids)
    kv.fork(parent, child)
    worker.live[child] = Seq(worker.live[parent].origins.copy())
    slots = kv.append_tokens([child], 1)
    assert len(kv.take_pending_copies()) == 1  # dropped
    position = BLOCK_SIZE + 5
    write_tokens(kv, slots, np.array([child]), np.array([position]))
    worker.live[child].origins = np.append(worker.live[child].origins, child)
    worker.check(parent)
    with pytest.raises(AssertionError, match=f"sequence {child} .*position {BLOCK_SIZE}"):
        worker.check(child)
