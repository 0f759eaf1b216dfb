"""The paged KV cache: `KVCachePool`, its bytes, and moving them.

The core (Rust) decides which blocks hold what; this class owns the bytes, in the layout
ATB's PagedAttention and vLLM's kernels read: for each layer a key and a value cache of
``[num_blocks, block_size, num_kv_heads, head_dim]``. All layers live in one region, taken
as one allocation from a ``MemPool`` — the caller's, or a private one of exactly that size —
shaped ``[layers_per_block, 2, num_blocks, block_size, num_kv_heads, head_dim]``, so moving a
block for every layer is one indexed copy along axis 2.

A hybrid model (``layer_types`` with sliding-window or chunked layers) has KV-cache groups:
a block belongs to one group at a time and holds the K/V of that group's layers, so layers at
the same place of different groups share one ``[num_blocks, ...]`` plane
(``layers_per_block`` planes in all) and ``group_of_layer`` says which.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from atb_mem import _core
from atb_mem._forwarding import bind_forwards
from atb_mem._types import (
    GroupPrefix,
    KVCacheGroup,
    KVCachePoolStats,
    PrefixExplanation,
    StateGroup,
)
from atb_mem.kv.block_bookkeeping import BlockBookkeeping
from atb_mem.kv.planning import plan_kv_cache
from atb_mem.kv.quantized_rows import quantize_rows
from atb_mem.kv.tensors import KVTensors
from atb_mem.memory.backends import NumpyBackend, TorchBackend, TorchRegion, backend_for
from atb_mem.memory.mem_pool import MemPool

__all__ = ["KVCachePool"]

# Config keys and the constructor argument each one sets.
_CONFIG_KEYS = {"max_pages": "num_blocks", "page_size": "block_size", **{name: name for name in (
    "num_blocks", "block_size", "num_layers", "num_kv_heads", "head_dim", "dtype",
    "enable_prefix_caching", "device", "num_host_blocks", "host_prefix_cache", "eviction_policy",
    "hash_block_size", "enable_kv_events", "layer_types", "sliding_window",
    "attention_chunk_size", "state_bytes", "state_checkpoint_interval", "kv_cache_dtype")}}

_DEFAULT_DEVICE = "host"

class KVCachePool(BlockBookkeeping):
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots, with their bytes.

    ``device``: ``"host"`` (default; numpy), ``"cpu"``, ``"cuda[:N]"``, ``"npu[:N]"`` (torch),
    or ``None`` for block bookkeeping without bytes. ``pool``: a ``MemPool`` to take the region
    from instead (its backing decides the device). ``num_host_blocks``: a host tier that
    ``swap_out`` moves sequences to (pinned memory when the device is CUDA); with
    ``host_prefix_cache=True`` it also keeps the cached blocks the device evicts, and a prefix
    lookup that misses on the device promotes them back (``explain_prefix`` says which tier
    each part of a hit comes from). ``eviction_policy``: which cached block goes first when a
    block is needed, ``"priority"`` (the default: least recently used first among the blocks
    of one retention priority, so plain LRU until ``set_retention`` asks for more; see
    ``atb_mem.kv.retention``), ``"lru"``, ``"lfu"`` or ``"slru"`` (which keep no priorities
    and refuse ``set_retention``).
    ``hash_block_size``: prefix keys every that many tokens (dividing ``block_size``), so a
    prompt that shares only the first part of a cached block copies that part instead of
    recomputing it (``explain_prefix(...).partial_tokens``).
    ``layer_types`` (transformers' per-layer names), ``sliding_window``,
    ``attention_chunk_size``: a hybrid model's KV-cache groups (see ``groups``); a window
    without ``layer_types`` makes every layer slide (Mistral). ``"linear_attention"`` layers
    (Mamba, gated delta-net) keep ``state_bytes`` per sequence each, in state blocks of the
    same pool (``state_groups``, ``state_table``); with prefix caching, a prefix hit resumes
    from a checkpoint of those states, kept at a prompt's last block boundary, where its
    shared prefix ends, and every ``state_checkpoint_interval`` blocks (default: as many as a
    checkpoint takes; ``checkpoint_state``, which a scheduler calls itself).

    Block 0 is the reserved null block (block tables are padded with it), so
    ``num_blocks - 1`` blocks hold tokens. The block bookkeeping is the core's (``core``, a
    ``_core.KVCachePool``): the methods and properties of ``BlockBookkeeping`` forward to
    it, and its per-request and per-step calls (``BOUND_FORWARDS``) are the core's own
    methods, bound on the instance (no Python frame per call).
    """

    _mem_pool: MemPool | None
    _own_pool: MemPool | None
    _region: _core.Allocation | None
    _tensors: KVTensors | None

    def __init__(self, num_blocks: int, block_size: int, *, device: Any = _DEFAULT_DEVICE,
                 pool: MemPool | None = None, num_host_blocks: int | None = None,
                 **kwargs: Any) -> None:
        self._mem_pool = pool
        self._own_pool = None
        self._region = None
        self._tensors = None
        if pool is not None and not isinstance(pool, (MemPool, _core.MemPool)):
            raise TypeError(f"pool must be a MemPool, got {type(pool).__name__}")
        self._core = _core.KVCachePool(num_blocks, block_size, num_host_blocks=num_host_blocks,
                                       **kwargs)
        bind_forwards(self, BlockBookkeeping, BlockBookkeeping.BOUND_FORWARDS)
        if pool is None and device is None:
            return
        if pool is not None:
            backend = _backend_of_pool(pool)
        else:
            backend = backend_for(device)
        dtype = backend.dtype(self.dtype if self.kv_cache_dtype == "auto" else "uint8")
        nbytes = self.num_blocks * self.bytes_per_block
        if pool is None:
            pool = MemPool(nbytes, alignment=1, backing=backend.region(nbytes))
            self._own_pool = pool
        self._region = pool.malloc(nbytes)
        self._mem_pool = pool
        kv = pool.view(self._region, dtype, self._shape(self.num_blocks))
        host_kv = None
        if num_host_blocks is not None:
            host_kv = backend.host_tensor(self._shape(self.num_host_blocks + 1), dtype)
        self._tensors = KVTensors(backend, kv, host_kv)

    @property
    def core(self) -> _core.KVCachePool:
        """The Rust block bookkeeping, for the core types that take it
        (``_core.ContinuousScheduler``)."""
        return self._core

    def _shape(self, blocks: int) -> tuple[int, ...]:
        row = self.head_dim if self.kv_cache_dtype == "auto" else _core.kv_layout_bytes(
            1, 1, self.head_dim, self.dtype, 1, self.kv_cache_dtype)[1] // 2  # bytes, scale in
        return (self.layers_per_block, 2, blocks, self.block_size, self.num_kv_heads, row)

    @property
    def groups(self) -> list[KVCacheGroup]:
        """The KV-cache groups, by first layer: one full-attention group of every layer
        unless ``layer_types``/``sliding_window`` made more."""
        return [KVCacheGroup(kind, tuple(layers), window)
                for kind, layers, window in self._core._groups]

    @property
    def state_groups(self) -> list[StateGroup]:
        """The recurrent (``"linear_attention"``) layers' state groups, by first layer."""
        return [StateGroup(tuple(layers), *sizes) for layers, *sizes in self._core._state_groups]

    # ---- the bytes -------------------------------------------------------------------------

    def explain_prefix(self, token_ids: Any, cache_salt: str | bytes | None = None
                       ) -> PrefixExplanation:
        """Why a prompt of ``token_ids`` would hit what it hits now, per group and in all,
        without changing anything (reasons: ``MISS_REASONS`` and ``"prefix_caching_off"``)."""
        hit, reason, limited_by, per_group, tiers, partial = self._core._explain_prefix(
            token_ids, cache_salt=cache_salt)
        groups = [GroupPrefix(index, group.kind, cached, why)
                  for index, (group, (cached, why)) in enumerate(zip(self.groups, per_group,
                                                                      strict=True))]
        return PrefixExplanation(hit, reason, limited_by, groups, tiers, partial)

    @property
    def device(self) -> str | None:
        """Where the blocks' bytes live (``"host"``, ``"cpu"``, ``"cuda:0"``, ...), or None."""
        tensors = self.tensors
        return None if tensors is None else tensors.backend.device

    @property
    def tensors(self) -> KVTensors | None:
        """The bytes and their executor (None without bytes)."""
        # getattr: __del__ and close() may run on an object __new__ never finished.
        return getattr(self, "_tensors", None)

    @property
    def mem_pool(self) -> MemPool | None:
        """The ``MemPool`` the block region came from (a private one unless ``pool=``)."""
        return getattr(self, "_mem_pool", None)

    @property
    def region(self) -> _core.Allocation | None:
        """The block region's allocation in ``mem_pool`` (None when closed or byte-less)."""
        return getattr(self, "_region", None)

    @property
    def kv_cache(self) -> Any:
        """All K/V bytes: ``[layers_per_block, 2, num_blocks, block_size, num_kv_heads,
        head_dim]`` (``layers_per_block`` is ``num_layers`` without groups)."""
        return self._require_bytes()

    @property
    def host_kv_cache(self) -> Any:
        """The host tier, shaped like ``kv_cache`` with ``num_host_blocks + 1`` blocks."""
        tensors = self._require_tensors()
        if tensors.host_kv is None:
            raise ValueError("this KV cache has no host tier: construct it with num_host_blocks")
        return tensors.host_kv

    def key_cache(self, layer: int) -> Any:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` keys of ``layer`` (a view)."""
        return self._require_bytes()[self._layer(layer), 0]

    def value_cache(self, layer: int) -> Any:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` values of ``layer`` (a view)."""
        return self._require_bytes()[self._layer(layer), 1]

    def _require_bytes(self) -> Any:
        return self._require_tensors().kv

    def _require_tensors(self) -> KVTensors:
        tensors = self.tensors
        if tensors is None:
            raise ValueError("this KV cache has no bytes (device=None, or closed)")
        return tensors

    def _layer(self, layer: Any) -> int:
        """The plane of ``kv_cache`` that holds ``layer``'s K/V."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range [0, {self.num_layers})")
        return int(self.group_of_layer(int(layer))[1])

    def write_kv(self, layer: int, slot_mapping: Any, key: Any, value: Any) -> None:
        """Scatters new tokens' K/V (``[num_tokens, num_kv_heads, head_dim]``) into their slots
        (ATB's ReshapeAndCache). Negative slots are padding and skipped; a slot in a block no
        sequence holds is an error. Shapes, dtypes and devices are checked before anything is
        written.

        Pending copy-on-write copies are applied first (a copy must land before a write
        into its block, or the write is lost), all under the pool's lock."""
        tensors = self._require_tensors()
        kv = tensors.kv
        layer = self._layer(layer)
        backend = tensors.backend
        slots = backend.to_numpy(slot_mapping)
        if slots.ndim != 1 or slots.dtype.kind not in "iu":
            raise TypeError(f"slot_mapping must be a 1-D integer array, got {slots.dtype} "
                            f"with shape {slots.shape}")
        expected = (len(slots), self.num_kv_heads, self.head_dim)
        quantized = self.kv_cache_dtype != "auto"
        model_dtype = backend.dtype(self.dtype) if quantized else kv.dtype
        for name, tensor in (("key", key), ("value", value)):
            if not backend.is_tensor(tensor):
                raise TypeError(f"{name} must be a {backend.name} array, got "
                                f"{type(tensor).__name__}")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
            if tensor.dtype != model_dtype:
                raise TypeError(f"{name} has dtype {tensor.dtype}; the cache holds "
                                f"{model_dtype}")
            if backend.name == "torch" and tensor.device != kv.device:
                raise ValueError(f"{name} is on {tensor.device}; the cache is on {kv.device}")
        if quantized:  # each token's rows from its own values (quantized_rows)
            key, value = (quantize_rows(backend, tensor, self.kv_cache_dtype, kv)
                          for tensor in (key, value))
        slots = slots.astype(np.int64, copy=False)
        self.write_slots(slots, tensors.execute,
                         lambda: tensors.scatter_kv(layer, slots, key, value))

    @property
    def executor(self) -> Any:
        """What executes block moves: ``execute(moves)`` of the bytes (int32 ``[k, 3]`` rows of
        kind, source, destination), or None without bytes (the moves then stay pending for
        the caller)."""
        tensors = self.tensors
        return None if tensors is None else tensors.execute

    def apply_pending_copies(self) -> int:
        """Executes the pending block moves (copy-on-write copies from forks), in order, for
        every layer, as one transaction: if a copy raises, the pool is rolled back and
        ``BlockMoveError`` says what was lost. Returns how many blocks moved."""
        if self.executor is None:
            return len(self.take_pending_copies())
        return self.execute_pending_moves(self.executor)

    def swap_out(self, seq_ids: Any, execute: Any = None) -> np.ndarray:
        """Moves the sequences' blocks to the host tier and frees their device blocks; a block
        they share is moved once. Pending copy-on-write copies run first. One transaction:
        plan, move the bytes, commit — or, if moving raises, roll back (``BlockMoveError``).
        Returns the (device block, host block) pairs moved."""
        return self._core.swap_out(seq_ids, execute or self.executor)

    def swap_in(self, seq_ids: Any, execute: Any = None) -> np.ndarray:
        """Brings swapped-out sequences back into free device blocks (their block tables
        change), as one transaction like ``swap_out``. Returns the (host block, device block)
        pairs moved."""
        return self._core.swap_in(seq_ids, execute or self.executor)

    def stats(self) -> KVCachePoolStats:
        """The core's figures (``_core.KVCachePool.stats``) and where the bytes are:
        ``device``, ``bytes_device``, ``bytes_host_tier``."""
        tensors = self.tensors
        held = 0 if tensors is None else self.num_blocks * self.bytes_per_block
        host = 0 if tensors is None or tensors.host_kv is None else \
            (self.num_host_blocks + 1) * self.bytes_per_block
        return {**self._core.stats(), "device": self.device, "bytes_device": held,
                "bytes_host_tier": host}

    def close(self) -> None:
        """Gives the block region back to its ``MemPool`` and drops the views. Idempotent."""
        region, self._region = getattr(self, "_region", None), None
        pool = getattr(self, "_mem_pool", None)
        if region is not None and pool is not None and not pool.closed:
            pool.free(region)
        own = getattr(self, "_own_pool", None)
        if own is not None:
            own.close()
        self._tensors = None

    def __enter__(self) -> KVCachePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # the pool may be gone at interpreter exit
            pass

    # ---- construction from figures --------------------------------------------------------

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KVCachePool:
        """Builds a pool from a config dict in the seeds' form.

        ``{"memory_mode": "paged", "page_size": 64, "max_pages": 1024}`` plus, optionally,
        ``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``enable_prefix_caching``,
        ``device`` and ``num_host_blocks``. ``max_pages`` counts every block, the null block
        included (it is ``num_blocks``); ``page_size`` is ``block_size``. Unknown keys are an
        error rather than silently ignored.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        mode = config.get("memory_mode", "paged")
        if mode != "paged":
            raise ValueError(f"memory_mode must be 'paged' for a KVCachePool, got {mode!r}")
        unknown = sorted(set(config) - set(_CONFIG_KEYS) - {"memory_mode"})
        if unknown:
            raise ValueError(
                f"unknown config key(s) {unknown}; expected some of "
                f"{sorted({*_CONFIG_KEYS, 'memory_mode'})}"
            )
        kwargs: dict[str, Any] = {}
        for key, value in config.items():
            if key == "memory_mode":
                continue
            argument = _CONFIG_KEYS[key]
            if argument in kwargs and kwargs[argument] != value:
                raise ValueError(f"config sets {argument} twice with different values")
            kwargs[argument] = value
        for required, aliases in (("num_blocks", "max_pages"), ("block_size", "page_size")):
            if required not in kwargs:
                raise ValueError(f"config needs {aliases!r} (or {required!r})")
        num_blocks = kwargs.pop("num_blocks")
        block_size = kwargs.pop("block_size")
        return cls(num_blocks, block_size, **kwargs)

    @classmethod
    def from_device(cls, device: str, *, gpu_memory_utilization: float = 0.85,
                    model_bytes: int = 0, block_size: int, num_layers: int, num_kv_heads: int,
                    head_dim: int, dtype: str = "float16", max_model_len: int,
                    safety: float = 0.9, **kwargs: Any) -> KVCachePool:
        """Sizes a pool from the device's memory (``torch.cuda.mem_get_info`` /
        ``torch.npu.mem_get_info``; the machine's RAM for ``"host"`` and ``"cpu"``) with
        :func:`atb_mem.plan_kv_cache`, never taking more blocks than are free now."""
        free, total = device_memory(device)
        plan = plan_kv_cache(total, model_bytes, gpu_memory_utilization=gpu_memory_utilization,
                             block_size=block_size, num_layers=num_layers,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                             max_model_len=max_model_len, safety=safety)
        num_blocks = min(plan.num_blocks, free // plan.bytes_per_block)
        if num_blocks - 1 < plan.blocks_per_seq:
            raise ValueError(f"only {free} bytes are free on {device}: fewer than one "
                             f"{max_model_len}-token sequence needs")
        return cls(num_blocks, block_size, device=device, num_layers=num_layers,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, **kwargs)


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of a device."""
    name = str(device)
    if name in ("host", "cpu"):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    backend_for(name)  # torch, and torch_npu for an npu, are there
    import torch

    if name.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(name))
    else:
        # torch_npu adds torch.npu; torch itself does not declare it.
        free, total = torch.npu.mem_get_info(torch.device(name))  # type: ignore[attr-defined]
    return int(free), int(total)


def _backend_of_pool(pool: MemPool) -> NumpyBackend | TorchBackend:
    backing = pool.backing
    if backing is None:
        raise ValueError("an offsets-only MemPool (backing=None) cannot hold KV-cache bytes")
    if isinstance(backing, TorchRegion):
        return TorchBackend(backing.device)
    if isinstance(backing, _core.HostRegion):
        return NumpyBackend()
    raise TypeError(f"cannot tell the device of a MemPool backed by {type(backing).__name__}")
