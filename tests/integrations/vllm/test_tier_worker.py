"""``TierWorker`` over torch CPU tensors shaped like vLLM's caches: blocks move whole and
bytes-exact between vLLM's blocks, the host tier and a disk tier, and a load that fails (a
damaged file, a late store) is reported, never served."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atb_mem.integrations.vllm.moves import TierMoves
from atb_mem.kv.tiers import DiskStore
from atb_mem.kv.tiers.store import block_key, frame
from tests.integrations.vllm.fakes import FakeStore

if os.environ.get("ATB_MEM_REQUIRE_TORCH"):
    import torch  # CI: without torch these fail, never skip
else:
    torch = pytest.importorskip("torch")

NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM = 10, 2, 4, 8
ID = "lay-tp0"
HASHES = [(0x1000 + at, 0x2000 + at) for at in range(4)]
KEYS = [block_key(ID, np.array(words, dtype=np.uint64)) for words in HASHES]


def caches(dtype: Any = torch.bfloat16, shape: tuple[int, ...] | None = None,
           layers: int = 3, seed: int = 0) -> dict[str, Any]:
    """vLLM's CPU caches: ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` per layer."""
    generator = torch.Generator().manual_seed(seed)
    shape = shape or (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    return {f"model.layers.{layer}.self_attn": torch.randn(shape, generator=generator)
            .to(dtype) for layer in range(layers)}


def block(kv: dict[str, Any], index: int, dim: int = 0) -> list[bytes]:
    """A block's bytes in every layer."""
    return [bytes(cache.select(dim, index).contiguous().view(-1).view(torch.uint8).numpy())
            for cache in kv.values()]


def worker(stores: list[Any], num_host_blocks: int = 6, load_timeout_s: float = 30.0) -> Any:
    from atb_mem.integrations.vllm.worker import TierWorker

    return TierWorker(num_host_blocks=num_host_blocks, stores=stores, layout="lay",
                      identity=ID, load_timeout_s=load_timeout_s)


def wait_finished(tier: Any, expected: set[str]) -> set[str]:
    """The requests ``finished`` reports, asked until they include ``expected`` (bounded)."""
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while not expected <= done and time.monotonic() < deadline:
        done |= tier.finished(0.05)
    return done


def save_to_disk(path: Path, kv: dict[str, Any], blocks: list[int]) -> None:
    """An engine that saves vLLM ``blocks`` to the host and puts them to the disk; its
    close waits for the writes."""
    disk = DiskStore(path, 1 << 20, min_seen=1)
    tier = worker([disk])
    tier.register(kv, NUM_BLOCKS)
    rows = list(range(1, len(blocks) + 1))
    tier.save(TierMoves(saves=list(zip(blocks, rows, strict=True)),
                        puts=[(True, row, *HASHES[at], ("DISK",))
                              for at, row in enumerate(rows)]))
    tier.close()
    assert disk.exists(KEYS[:len(blocks)]) == [True] * len(blocks)


def test_register_sizes_the_block_across_layers(tmp_path: Path) -> None:
    disk = DiskStore(tmp_path, 1 << 20)
    tier = worker([disk])
    assert tier.register(caches(), NUM_BLOCKS) == 3 * HEADS * BLOCK * 2 * HEAD_DIM * 2
    assert disk.layout_path is not None and disk.layout_path.name == "lay"
    tier.close()


def test_a_block_saved_to_the_disk_loads_back_bytes_exact(tmp_path: Path) -> None:
    source = caches(seed=1)
    save_to_disk(tmp_path, source, [3, 4])
    kv = caches(seed=2)  # another engine, the same layout
    tier = worker([DiskStore(tmp_path, 1 << 20)])
    tier.register(kv, NUM_BLOCKS)
    untouched = block(kv, 5)
    tier.start_loads(TierMoves(store_loads={"r": [(*HASHES[0], 7), (*HASHES[1], 8)]}))
    assert tier.num_loading == 1
    assert wait_finished(tier, {"r"}) == {"r"}
    assert block(kv, 7) == block(source, 3) and block(kv, 8) == block(source, 4)
    assert block(kv, 5) == untouched
    assert tier.load_errors() == set() and tier.num_loading == 0
    counters = tier.take_counters()
    assert counters["loaded_blocks_DISK"] == 2 and "load_failures" not in counters
    tier.close()


def test_host_copies_and_loads(tmp_path: Path) -> None:
    kv = caches(dtype=torch.float32)
    original = {at: block(kv, at) for at in range(NUM_BLOCKS)}
    tier = worker([])
    tier.register(kv, NUM_BLOCKS)
    tier.save(TierMoves(saves=[(3, 1), (4, 2)]))
    assert tier.take_counters()["saved_blocks_HOST"] == 2
    # The copy runs before the loads that read it.
    tier.start_loads(TierMoves(host_copies=[(2, 5)], host_loads=[(1, 8), (5, 9)]))
    assert block(kv, 8) == original[3] and block(kv, 9) == original[4]
    assert all(block(kv, at) == original[at] for at in range(8))
    assert tier.take_counters()["loaded_blocks_HOST"] == 2
    assert tier.finished() == set()
    tier.close()


def test_a_put_without_a_host_tier_reads_the_vllm_block(tmp_path: Path) -> None:
    kv = caches()
    disk = DiskStore(tmp_path, 1 << 20, min_seen=1)
    tier = worker([disk], num_host_blocks=0)
    tier.register(kv, NUM_BLOCKS)
    tier.save(TierMoves(puts=[(False, 6, *HASHES[0], ("DISK",))]))
    tier.close()
    assert disk.get(KEYS[0]) == frame(b"".join(block(kv, 6)), True, KEYS[0])


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_file_fails_its_block_and_the_ones_after(tmp_path: Path,
                                                            damage: str) -> None:
    source = caches(seed=1)
    save_to_disk(tmp_path, source, [1, 2, 3])
    disk = DiskStore(tmp_path, 1 << 20)
    kv = caches(seed=2)
    tier = worker([disk])
    tier.register(kv, NUM_BLOCKS)
    assert disk.layout_path is not None
    path = disk.layout_path / (KEYS[1].replace("/", "-") + ".kv")
    data = path.read_bytes()
    if damage == "corrupt":
        path.write_bytes(data[:-7] + bytes([data[-7] ^ 0x40]) + data[-6:])
    elif damage == "truncate":
        path.write_bytes(data[:len(data) // 2])
    else:
        path.unlink()
    before = {at: block(kv, at) for at in (7, 8)}
    tier.start_loads(TierMoves(store_loads={"r": [(*HASHES[at], 6 + at) for at in range(3)]}))
    assert wait_finished(tier, {"r"}) == {"r"}, "a failed load is finished too"
    assert tier.load_errors() == {7, 8}
    assert tier.load_errors() == set()
    assert block(kv, 6) == block(source, 1)
    assert {at: block(kv, at) for at in (7, 8)} == before, "nothing served from there"
    counters = tier.take_counters()
    assert counters["load_failures"] == 1 and counters["loaded_blocks_DISK"] == 1
    assert counters.get("corrupt_blocks", 0) == (damage != "delete")
    assert disk.exists(KEYS[:3]) == [True, False, True], "the damaged block is forgotten"
    tier.close()


class GatedStore(FakeStore):
    """A store whose reads wait until ``gate`` is set: slower than any load timeout."""

    def __init__(self) -> None:
        super().__init__("MOONCAKE")
        self.gate = threading.Event()

    def get(self, key: str) -> Any:
        self.gate.wait(30)
        return super().get(key)


def test_a_late_load_is_reported_failed_and_never_lands() -> None:
    kv = caches()
    store = GatedStore()
    tier = worker([store], load_timeout_s=0.02)
    tier.register(kv, NUM_BLOCKS)
    payload = bytes(len(b"".join(block(kv, 0))))  # zeros: intact, had it come in time
    store.data[KEYS[0]] = frame(payload, True, KEYS[0])
    before = block(kv, 4)
    tier.start_loads(TierMoves(store_loads={"r": [(*HASHES[0], 4)]}))
    assert tier.finished(0.05) == {"r"}  # waited 0.05 s, past the 0.02 s allowed
    assert tier.load_errors() == {4} and tier.num_loading == 0
    assert tier.take_counters()["load_failures"] == 1
    store.gate.set()
    tier.close()  # the read ends now
    assert store.gets == [KEYS[0]] and block(kv, 4) == before
    assert tier.finished() == set() and tier.load_errors() == set()


def test_the_block_dimension_need_not_come_first() -> None:
    # FlashAttention's layout: [2 (K, V), num_blocks, block_size, kv_heads, head_dim].
    kv = caches(shape=(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM))
    original = {at: block(kv, at, dim=1) for at in range(NUM_BLOCKS)}
    tier = worker([])
    assert tier.register(kv, NUM_BLOCKS) == 3 * 2 * BLOCK * HEADS * HEAD_DIM * 2
    tier.save(TierMoves(saves=[(3, 1)]))
    tier.start_loads(TierMoves(host_loads=[(1, 9)]))
    assert block(kv, 9, dim=1) == original[3]
    assert all(block(kv, at, dim=1) == original[at] for at in range(9))
    tier.close()


def test_caches_the_worker_cannot_take_are_refused() -> None:
    tier = worker([])
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn'.*no dimension of 11"):
        tier.register(caches(), 11)
    mixed = {"a": caches(layers=1)["model.layers.0.self_attn"],
             "b": caches(shape=(NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM), layers=1)[
                 "model.layers.0.self_attn"]}
    with pytest.raises(ValueError, match="every layer's block alike"):
        tier.register(mixed, NUM_BLOCKS)
    tier.close()


def test_a_store_that_stopped_taking_blocks_costs_no_copy(tmp_path: Path) -> None:
    """After the disk went full, a put planned for it (the scheduler hears a step later) is
    neither copied nor checksummed, and the worker says which stores stopped."""
    disk = DiskStore(tmp_path, 1 << 20, min_seen=1)
    tier = worker([disk])
    tier.register(caches(), NUM_BLOCKS)
    assert tier.stopped_stores() == frozenset()
    disk.writable = False  # what a failed write leaves
    copied: list[int] = []
    bytes_of = tier._bytes_of
    tier._bytes_of = lambda from_host, block: copied.append(block) or bytes_of(from_host, block)
    tier.save(TierMoves(puts=[(False, 2, *HASHES[0], ("DISK",))]))
    tier.close()
    assert copied == [] and disk.exists(KEYS[:1]) == [False]
    assert tier.stopped_stores() == frozenset({"DISK"})


@pytest.mark.parametrize("in_step", [False, True])
def test_a_producers_puts_land_before_its_step_ends(in_step: bool) -> None:
    """A prefill server answers once its step ends: with ``puts_land_in_step`` its blocks
    are in the store by then (a slow store shows the difference)."""
    from atb_mem.integrations.vllm.worker import TierWorker

    class SlowStore(FakeStore):
        def put(self, key: str, value: Any) -> bool:
            time.sleep(0.3)
            return super().put(key, value)

    store = SlowStore("MOONCAKE")
    tier = TierWorker(num_host_blocks=0, stores=[store], layout="lay", identity=ID,
                      puts_land_in_step=in_step)
    tier.register(caches(), NUM_BLOCKS)
    tier.save(TierMoves(puts=[(False, 2, *HASHES[0], ("MOONCAKE",)),
                              (False, 3, *HASHES[1], ("MOONCAKE",))]))
    assert (store.exists(KEYS[:2]) == [True, True]) is in_step
    tier.close()
    assert store.exists(KEYS[:2]) == [True, True]


@pytest.mark.parametrize("per_copy, expected", [(None, [[9, 8, 7, 6]]),
                                                (2, [[9, 8], [7, 6]]), (3, [[9, 8, 7], [6]])])
def test_a_load_lands_its_blocks_in_one_copy_per_layer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_copy: int | None,
        expected: list[list[int]]) -> None:
    """Four blocks from the disk land as one indexed copy per layer, not one per block and
    layer (or as few copies as a landing buffer of ``per_copy`` blocks allows); bytes-exact,
    in their own vLLM blocks."""
    from atb_mem.kv.tiers import block_io

    if per_copy is not None:
        monkeypatch.setattr(block_io, "LANDING_BYTES",
                            per_copy * 3 * HEADS * BLOCK * 2 * HEAD_DIM * 2)
    source = caches(seed=1)
    save_to_disk(tmp_path, source, [1, 2, 3, 4])
    kv = caches(seed=2)
    tier = worker([DiskStore(tmp_path, 1 << 20)])
    tier.register(kv, NUM_BLOCKS)
    copies: list[list[int]] = []
    to_vllm = tier._to_vllm

    def counted(source: Any, rows: Any, blocks: Any) -> int:
        copies.append(list(blocks))
        return to_vllm(source, rows, blocks)

    tier._to_vllm = counted
    tier.start_loads(TierMoves(store_loads={"r": [(*HASHES[at], 9 - at) for at in range(4)]}))
    assert wait_finished(tier, {"r"}) == {"r"}
    assert copies == expected
    assert [block(kv, 9 - at) for at in range(4)] == [block(source, at + 1) for at in range(4)]
    tier.close()


def test_disk_loads_before_the_forward_land_at_once_and_report_what_failed(
        tmp_path: Path) -> None:
    """``disk_loads`` are read and landed within ``start_loads`` (before the forward that
    reads them), bytes-exact; the requests are reported by ``loaded_now``, never by
    ``finished``; a damaged block and the ones after it go to ``load_errors`` (vLLM
    recomputes from there), counted corrupt."""
    source = caches(seed=1)
    save_to_disk(tmp_path, source, [1, 2, 3])
    damaged = next(tmp_path.rglob(f"*{KEYS[2].rsplit('/', 1)[-1]}*"))
    value = bytearray(damaged.read_bytes())
    value[len(value) // 2] ^= 0xFF
    damaged.write_bytes(bytes(value))
    kv = caches(seed=2)
    tier = worker([DiskStore(tmp_path, 1 << 20)])
    tier.register(kv, NUM_BLOCKS)
    tier.start_loads(TierMoves(disk_loads={
        "r": [(*HASHES[0], 7), (*HASHES[1], 8)], "s": [(*HASHES[2], 9)]}))
    assert [block(kv, 7), block(kv, 8)] == [block(source, 1), block(source, 2)]
    assert tier.loaded_now() == {"r", "s"} and tier.loaded_now() == set()
    assert tier.num_loading == 0 and tier.finished() == set()
    assert tier.load_errors() == {9}
    counters = tier.take_counters()
    assert counters["loaded_blocks_DISK"] == 2 and counters["corrupt_blocks"] == 1
    assert counters["load_failures"] == 1
    tier.close()


def test_a_tail_is_copied_to_the_host_first_and_its_request_reported() -> None:
    """An ended request's last block (vLLM's 7) goes to host block 3 first thing in the
    step: a host load that reads host block 3 into vLLM's 8 sees the tail's bytes, and the
    request is reported once (vLLM frees its blocks then)."""
    kv = caches(seed=3)
    tier = worker([], num_host_blocks=6)
    tier.register(kv, NUM_BLOCKS)
    tier.save(TierMoves(saves=[(2, 4)]))  # host block 4: block 2's bytes
    tail, held = block(kv, 7), block(kv, 2)
    tier.start_loads(TierMoves(tail_saves=[("r", 7, 3)], host_loads=[(4, 7), (3, 8)]))
    assert block(kv, 8) == tail and block(kv, 7) == held
    assert tier.tails_copied() == {"r"} and tier.tails_copied() == set()
    assert tier.take_counters()["saved_blocks_HOST"] == 2
    tier.close()
