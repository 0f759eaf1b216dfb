"""The worker side of ``AtbMemConnector``: it copies whole blocks between vLLM's layer caches
and the tiers, exactly as the scheduler side's ``TierMoves`` say, and decides nothing.

Bytes inside a vLLM block are in the attention backend's layout (the CPU backend stores the
K half transposed), so blocks move whole and are never sliced into tokens. The host tier is
one preallocated buffer ``[num_host_blocks + 1, groups, caches, *block]`` (block 0 unused, as
in the index; one KV-cache group and a cache per layer but under vLLM's hybrid manager, whose
groups share the caches); a block's bytes for the disk or the store are that row, framed with
a checksum and its key. Disk and store reads run on threads; what they fetched is copied into
vLLM's blocks on the worker's thread, after the step's forward, and the request reported done
(``finished``) with, for a block that was missing, damaged or late, its vLLM block in
``load_errors``: vLLM recomputes from there.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from atb_mem.integrations.vllm.moves import HOST, TierMoves, VllmBlock, group_ids, whole
from atb_mem.kv.tiers.block_io import BlockFetch, BlockWriter, landing_chunks
from atb_mem.kv.tiers.store import KVStore, block_key, framed_size, key_hash

__all__ = ["TierWorker"]

log = logging.getLogger("atb_mem.vllm")


@dataclass
class _Load:
    req_id: str
    blocks: list[VllmBlock]
    fetch: BlockFetch
    """A late load lands the leading part of what it fetched."""


class TierWorker:
    """Executes ``TierMoves`` over the layer caches registered with ``register``."""

    def __init__(self, *, num_host_blocks: int, stores: Sequence[KVStore], layout: str,
                 identity: str, load_timeout_s: float = 30.0, puts_land_in_step: bool = False,
                 groups: int = 1) -> None:
        self.num_host_blocks = num_host_blocks
        self.groups = groups
        # A prefill server's puts land before its step ends, so that the request's answer
        # (what sends it on to a decode server) comes after its blocks are in the store.
        self.puts_land_in_step = puts_land_in_step
        self.stores = list(stores)
        self.layout, self.identity = layout, identity
        self.load_timeout_s = load_timeout_s
        self._views: list[Any] = []
        self._on_host = True
        self._host: Any = None
        self._staging: Any = None
        self._landing: Any = None
        self._block_bytes = 0
        self._loads: list[_Load] = []
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        self._tails_copied: set[str] = set()
        self._fetchers = ThreadPoolExecutor(2, thread_name_prefix="atb-mem-vllm-load")
        # Loads before the forward never queue behind the asynchronous ones.
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="atb-mem-vllm-load-now")
        self._loaded_now: set[str] = set()
        self._writer = BlockWriter(lambda store, error: self._count(store_errors=1),
                                   "atb-mem-vllm-save")
        self._lock = threading.Lock()  # the counters, which the writer updates too
        self._errors_seen = 0
        self.counters: dict[str, float] = {}
        self.record_events = False
        self._events: list[tuple[str, bool, int, int]] = []

    # ---- set-up -----------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, Any], num_blocks: int) -> int:
        """Takes vLLM's layer caches (each with a dimension of ``num_blocks`` blocks) and
        allocates the host tier; returns the bytes of one block across layers."""
        import torch

        views, seen = [], set()
        for name, cache in kv_caches.items():
            dims = [dim for dim, size in enumerate(cache.shape) if size == num_blocks]
            if not dims:
                raise ValueError(f"vLLM's cache of layer {name!r}, shaped "
                                 f"{tuple(cache.shape)}, has no dimension of {num_blocks} "
                                 f"blocks")
            view = cache.movedim(dims[0], 0)
            # The hybrid manager's groups share caches: each is moved once.
            key = (view.data_ptr(), view.shape, view.stride())
            if key not in seen:
                seen.add(key)
                views.append(view)
        shapes = {(tuple(view.shape[1:]), view.dtype) for view in views}
        if len(shapes) != 1:
            raise ValueError(f"AtbMemConnector needs every layer's block alike, got {shapes}")
        (block_shape, dtype), = shapes
        self._views = views
        self._on_host = views[0].device.type == "cpu"
        shape = (self.groups, len(views), *block_shape)
        pin = views[0].device.type == "cuda"
        if self.num_host_blocks:  # written now: no page faults inside a step's first saves
            self._host = torch.zeros((self.num_host_blocks + 1, *shape), dtype=dtype,
                                     pin_memory=pin)
        self._staging = torch.empty((1, *shape), dtype=dtype, pin_memory=pin)
        self._block_bytes = self._staging[0].numel() * self._staging.element_size()
        for store in self.stores:
            register_layout = getattr(store, "register_layout", None)
            if register_layout is not None:
                register_layout(self.layout, framed_size(self._block_bytes))
        return self._block_bytes

    # ---- block copies -----------------------------------------------------------------------

    def _by_group(self, rows: Sequence[int], blocks: Sequence[VllmBlock]
                  ) -> list[tuple[list[int], list[int]]]:
        """Per KV-cache group: the rows of ``blocks`` it holds and their vLLM ids (a block a
        window let go, 0, is skipped: it is vLLM's null block)."""
        ids = [group_ids(block) for block in blocks]
        found = []
        for group in range(self.groups):
            held = [(row, each[group]) for row, each in zip(rows, ids, strict=True)
                    if each[group]]
            found.append(([row for row, _ in held], [block for _, block in held]))
        return found

    def _to_vllm(self, source: Any, rows: Sequence[int], blocks: Sequence[VllmBlock]) -> int:
        """``source[rows]`` (host rows ``[k, groups, caches, *block]``) into vLLM ``blocks``;
        returns the bytes copied (a group's block vLLM let go is not)."""
        return self._copy(source, rows, blocks, into_vllm=True)

    def _from_vllm(self, target: Any, rows: Sequence[int], blocks: Sequence[VllmBlock]
                   ) -> None:
        self._copy(target, rows, blocks, into_vllm=False)

    def _copy(self, host: Any, rows: Sequence[int], blocks: Sequence[VllmBlock],
              into_vllm: bool) -> int:
        """Host rows ``rows`` to or from vLLM ``blocks``; the bytes moved. On the host, a plain
        copy per block and cache (Qwen3-0.6B's 14 MiB blocks: 18-20 GB/s; a gather into a
        temporary and an indexed assignment ran at 2-4 GB/s); on a device, a gather per cache
        there and one transfer."""
        import torch

        copied = 0
        for group, (held, ids) in enumerate(self._by_group(rows, blocks)):
            copied += len(held) * self._block_bytes // self.groups
            if self._on_host:
                for row, block in zip(held, ids, strict=True):
                    for cache, view in enumerate(self._views):
                        pair = (view[block], host[row, group, cache])
                        target, source = pair if into_vllm else pair[::-1]
                        target.copy_(source)
                continue
            on_device = torch.tensor(ids, dtype=torch.long, device=self._views[0].device)
            for cache, view in enumerate(self._views):
                if into_vllm:
                    view[on_device] = host[held, group, cache].to(view.device)
                else:
                    host[held, group, cache] = view[on_device].to(host.device)
        return copied

    def _bytes_of(self, from_host: bool, block: VllmBlock) -> bytes:
        """One block's bytes, copied now (the block may be overwritten after this step)."""
        if from_host:
            row = self._host[block]
        else:
            self._from_vllm(self._staging, [0], [block])
            row = self._staging[0]
        return bytes(row.view(-1).view(dtype=_uint8()).numpy())

    # ---- a step -----------------------------------------------------------------------------

    def start_loads(self, moves: TierMoves) -> None:
        """The host copies and loads now (before the forward that reads them); the disk and
        store fetches on threads. First the ended requests' tails into the host."""
        if moves.tail_saves:
            req_ids, blocks, rows = zip(*moves.tail_saves, strict=True)
            try:
                self._from_vllm(self._host, rows, blocks)
                self._count(**{f"saved_blocks_{HOST}": len(rows)},
                            saved_bytes=len(rows) * self._block_bytes)
            finally:  # vLLM holds their blocks until told, copied or not
                self._tails_copied.update(req_ids)
        if moves.host_copies:
            src, dst = zip(*moves.host_copies, strict=True)
            self._host[list(dst)] = self._host[list(src)]
        if moves.host_loads:
            rows, blocks = zip(*moves.host_loads, strict=True)
            copied = self._to_vllm(self._host, rows, blocks)
            self._count(**{f"loaded_blocks_{HOST}": len(rows)}, loaded_bytes=copied)
        if moves.disk_loads:
            self._load_now(moves.disk_loads)
        self._loads += [self._fetch(req_id, loads, self._fetchers)
                        for req_id, loads in moves.store_loads.items()]

    def _fetch(self, req_id: str, loads: list[tuple[int, int, VllmBlock]],
               pool: ThreadPoolExecutor) -> _Load:
        """A load of ``loads`` ((hash word 0, hash word 1, vLLM block) each), fetched on
        ``pool``."""
        fetch = BlockFetch([block_key(self.identity, (high, low)) for high, low, _ in loads])
        fetch.start(pool, self.stores, self._block_bytes, True,
                    lambda: self._count(corrupt_blocks=1))
        return _Load(req_id, [block for _, _, block in loads], fetch)

    def _load_now(self, disk_loads: Mapping[str, list[tuple[int, int, VllmBlock]]]) -> None:
        """Reads the requests' disk blocks (in parallel, at most the load timeout in all)
        and lands what arrived intact; vLLM recomputes from a block that did not
        (``load_errors``, reported this step)."""
        loads = [self._fetch(req_id, blocks, self._readers)
                 for req_id, blocks in disk_loads.items()]
        deadline = time.perf_counter() + self.load_timeout_s
        for load in loads:
            load.fetch.wait(max(0.0, deadline - time.perf_counter()))
            self._end(load)
            self._loaded_now.add(load.req_id)

    def loaded_now(self) -> frozenset[str]:
        """The requests whose disk loads ran before the forward since the last call."""
        loaded, self._loaded_now = frozenset(self._loaded_now), set()
        return loaded

    def save(self, moves: TierMoves) -> None:
        """After the forward: vLLM blocks → host blocks, then the puts to the stores."""
        if moves.saves:
            blocks, rows = zip(*moves.saves, strict=True)
            self._from_vllm(self._host, rows, blocks)
            self._count(**{f"saved_blocks_{HOST}": len(rows)},
                        saved_bytes=len(rows) * self._block_bytes)
        writes = []
        for from_host, block, high, low, names in moves.puts:
            # A store that stopped taking blocks costs no copy and no checksum (the
            # scheduler side stops planning them once it hears, a step later).
            stores = [store for store in self.stores
                      if store.name in names and getattr(store, "writable", True)]
            if not stores:
                continue
            key = block_key(self.identity, (high, low))
            write = self._writer.submit(key, self._bytes_of(from_host, block), stores, True,
                                        functools.partial(self._put, key))
            if write is None:
                self._count(dropped_puts=1)
            else:
                writes.append(write)
        if self.puts_land_in_step and writes:
            futures_wait(writes, timeout=self.load_timeout_s)

    def _put(self, key: str, taken: list[KVStore], framed: int) -> None:
        """Counts a block the stores ``taken`` took (on the writer), with its events."""
        for store in taken:
            self._count(**{f"saved_blocks_{store.name}": 1})
            if self.record_events:
                self._record(store, key)

    def _record(self, store: KVStore, key: str) -> None:
        """A block ``store`` took, after the blocks it evicted for it."""
        medium = store.medium.upper()
        evicted: list[str] = getattr(store, "take_evicted", list)()
        with self._lock:
            self._events.extend((medium, False, *key_hash(name)) for name in evicted)
            self._events.append((medium, True, *key_hash(key)))

    def take_events(self) -> list[tuple[str, bool, int, int]]:
        """(medium, stored, hash words) of the blocks the disk and the store took or evicted
        since the last call (with ``record_events``)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def finished(self, wait_s: float = 0.0) -> set[str]:
        """Copies the fetches that arrived into their vLLM blocks; returns the requests
        whose loads ended (a failed one too: its blocks are in ``load_errors``)."""
        if not self._loads:
            return set()
        if wait_s > 0 and not any(load.fetch.done for load in self._loads):
            self._loads[0].fetch.wait(wait_s)
        now, done = time.perf_counter(), set()
        for load in list(self._loads):
            if not load.fetch.done and not load.fetch.late(now, self.load_timeout_s):
                continue
            self._loads.remove(load)
            done.add(load.req_id)
            self._end(load)
        return done

    def _end(self, load: _Load) -> None:
        """Lands what the load's fetch read in time into its blocks; the rest goes to
        ``load_errors`` (recomputed)."""
        req_id, blocks, fetch = load.req_id, load.blocks, load.fetch
        now = time.perf_counter()
        if not fetch.done:  # what arrived in time lands; the rest is recomputed
            fetch.cancelled.set()
            log.warning("atb-mem: a load took over %s s: its blocks from the first one "
                        "missing then are recomputed", self.load_timeout_s)
        landed = 0
        try:
            landed = self._land(blocks, fetch.intact())
        except Exception as error:  # a copy that failed: recomputed
            log.warning("atb-mem: landing a load of %s failed: %s", req_id, error)
        if landed < len(blocks):
            if self.groups == 1:  # not vLLM's null block (a windowed model's), never loaded
                self._errors.update(block for block in blocks[landed:]  # type: ignore[misc]
                                    if whole(block))
            else:  # vLLM cannot tell one group's block ids from another's
                self._failed.add(req_id)
            self._count(load_failures=1)
        begun = fetch.started[0] if fetch.started else now
        self._count(load_seconds_sum=time.perf_counter() - begun, loads=1)

    def _land(self, blocks: list[VllmBlock], intact: list[tuple[bytes, str]]) -> int:
        """Copies a fetch's leading intact blocks in, a landing buffer's worth at a time
        (one indexed copy per layer each time, not one per block and layer); returns how
        many landed."""
        landed = 0
        for start, chunk in landing_chunks(intact[:len(blocks)], self._block_bytes):
            buffer = self._landing_rows(len(chunk))
            rows = buffer.view(len(buffer), -1).view(dtype=_uint8()).numpy()
            for row, (payload, _) in enumerate(chunk):
                rows[row] = np.frombuffer(payload, dtype=np.uint8)
            copied = self._to_vllm(buffer, list(range(len(chunk))),
                                   blocks[start:start + len(chunk)])
            landed += len(chunk)
            tiers = Counter(f"loaded_blocks_{tier}" for _, tier in chunk)
            self._count(**tiers, loaded_bytes=copied)
        return landed

    def _landing_rows(self, count: int) -> Any:
        """The first ``count`` rows of the landing buffer, grown to that many if need be (it
        stays: loads reuse it)."""
        import torch

        if self._landing is None or len(self._landing) < count:
            self._landing = torch.empty((count, *self._staging.shape[1:]),
                                        dtype=self._staging.dtype,
                                        pin_memory=self._staging.is_pinned())
        return self._landing[:count]

    def load_errors(self) -> set[int]:
        """vLLM blocks whose loads failed since the last call."""
        errors, self._errors = self._errors, set()
        return errors

    def tails_copied(self) -> set[str]:
        """The ended requests whose last blocks were copied since the last call: vLLM may
        free their blocks now."""
        copied, self._tails_copied = self._tails_copied, set()
        return copied

    def failed_requests(self) -> set[str]:
        """With several KV-cache groups: the requests whose loads failed since the last call
        (their blocks' ids do not say their group); vLLM recomputes them whole."""
        failed, self._failed = self._failed, set()
        return failed

    def _count(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self.counters[name] = self.counters.get(name, 0) + amount

    def stopped_stores(self) -> frozenset[str]:
        """The names of the stores that stopped taking blocks (a disk gone full or
        read-only)."""
        return frozenset(store.name for store in self.stores
                         if not getattr(store, "writable", True))

    def take_counters(self) -> dict[str, float]:
        """The counts since the last call (a store's failed calls in ``store_errors``)."""
        errors = sum(getattr(store, "errors", 0) for store in self.stores)
        self._count(store_errors=errors - self._errors_seen)
        self._errors_seen = errors
        with self._lock:
            counters, self.counters = self.counters, {}
        return counters

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        self._fetchers.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._writer.close()
        for store in self.stores:
            store.close()


def _uint8() -> Any:
    import torch

    return torch.uint8

