"""Eight threads move real bytes through one KVCachePool, checked against a byte oracle.

Compound operations must be one transaction each: ``swap_out`` (plan, copy device→host,
free), ``swap_in``, ``apply_pending_copies`` and ``write_kv`` (pending copy-on-write moves,
then the scatter). Were any of them split — device blocks freed before their bytes were
copied out, or pending copies taken by one thread and executed later without the lock —
another thread could take those blocks and write its own tokens into them in between, or
write into a copy's destination before the copy lands, and some sequence's bytes would end
up wrong.

Each of eight threads (``bytes_worker``) checks its own sequences' bytes against a byte oracle
(``byte_oracle``) after each of its calls, while the others keep running.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from tests.kv.byte_oracle import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    NUM_HOST_BLOCKS,
    Seq,
    check_bytes,
    new_pool,
    write_tokens,
)
from tests.kv.bytes_worker import JOIN_SECONDS, Worker

NUM_THREADS = 8


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
