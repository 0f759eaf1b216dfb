"""The shapes of what atb-mem takes and returns: the dicts (``stats()``, ``config()``,
``snapshot()``) as TypedDicts, and the closed sets of strings as Literals.

The binding's (``_core.pyi`` uses them) come first, then what the Python classes add.
tests/package/test_types.py checks every TypedDict against a dict the code really returns.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Protocol, TypedDict

# ---- choices --------------------------------------------------------------------------------

KVDtype = Literal["float16", "bfloat16", "float32", "int8"]
KVCacheDtype = Literal["auto", "int8", "fp8_e4m3"]
"""A KV cache's element type, as ``KVCachePool.dtype`` names it."""
KVDtypeAlias = Literal["fp16", "half", "bf16", "fp32", "float"]
"""Other names the constructor accepts for the same types."""
AlignmentPolicy = Literal["default", "ascend"]
"""How a ``MemPool`` rounds a request: to its alignment, or by CANN's rule (ALIGN_UP(n, 32) +
32, from a 64-byte boundary)."""
Preemption = Literal["recompute", "swap"]
"""What the continuous scheduler does with a sequence it preempts."""
TimeoutAction = Literal["reject", "delay"]
"""What the request batcher does with a request that outlived its timeout."""
AttentionBackend = Literal["auto", "torch", "flashinfer", "cpu"]
"""The attention a model runner uses: FlashInfer's paged kernel where it runs (CUDA), the torch
reference, or the first that works (``"auto"``)."""
BackendName = Literal["numpy", "torch"]
"""What holds a KV cache's bytes: numpy arrays on the host, or torch tensors on a device."""


class MemoryBacking(Protocol):
    """What can own a ``MemPool``'s bytes: a base address, a size, and views of byte ranges
    (``HostRegion``, ``atb_mem.memory.backends.TorchRegion``, or a caller's object)."""

    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def view(self, offset: int, nbytes: int, dtype: Any, shape: Any) -> Any: ...


# ---- the binding's dicts ----------------------------------------------------------------------


class KVCacheStats(TypedDict):
    """``_core.KVCachePool.stats()``: blocks, tokens, slots and the prefix cache's counters."""

    num_blocks: int
    block_size: int
    blocks_total: int
    blocks_reserved: int  # the null block
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    num_sequences: int
    num_tokens: int
    allocated_slots: int
    used_slots: int
    fragmentation: float  # allocated but unused slots over allocated slots
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    evictions: int
    pending_copies: int
    bytes_per_block: int
    bytes_total: int
    host_blocks: int
    host_blocks_used: int
    num_swapped: int
    # The host prefix cache (host_prefix_cache=True): what it holds, what it served, and the
    # device evictions it kept (skipped: a copy was there; dropped: no host block was free).
    host_blocks_cached: int
    prefix_cache_host_hit_tokens: int
    host_prefix_demoted: int
    host_prefix_demotions_skipped: int
    host_prefix_demotions_dropped: int
    host_prefix_promoted: int
    # Of prefix_cache_hit_tokens, those copied from a block a prompt shares only the first
    # pieces of (hash_block_size).
    prefix_cache_partial_hit_tokens: int
    # Of prefix_cache_hit_tokens, those loaded from the disk and from a shared store.
    prefix_cache_disk_hit_tokens: int
    prefix_cache_store_hit_tokens: int
    # Admissions whose prefix hit fell short, by reason (see KVCachePool.explain_prefix).
    prefix_cache_misses_block_alignment: int
    prefix_cache_misses_not_cached: int
    prefix_cache_misses_evicted: int
    prefix_cache_misses_window: int
    prefix_cache_misses_state_checkpoint: int
    # Checkpoints of recurrent states kept (a hybrid model's prefix hits resume from one).
    state_checkpoints_saved: int
    state_checkpoints_failed: int  # dropped: their copies failed
    num_groups: int  # KV-cache groups (1 without layer types)


# torch's key names have dots, so the functional form.
MemPoolStats = TypedDict("MemPoolStats", {
    "capacity": int,
    "alignment": int,
    "policy": AlignmentPolicy,
    "allocated_bytes.current": int,
    "allocated_bytes.peak": int,
    "requested_bytes.current": int,
    "reserved_bytes.current": int,
    "reserved_bytes.peak": int,
    "active_allocations.current": int,
    "free_bytes": int,
    "largest_free": int,
    "free_ranges": int,
    "fragmentation": float,
    "sawicki_fragmentation": float,
    "num_allocs": int,
    "num_frees": int,
    "num_ooms": int,
    "max_allocations": int,
})
"""``MemPool.stats()``, in torch's ``memory_stats()`` names where there is one."""


class LiveAllocation(TypedDict):
    """One entry of ``MemPool.snapshot()``."""

    offset: int
    size: int
    requested: int
    ptr: int


class RequestBatcherConfig(TypedDict):
    """``_core.RequestBatcher``'s configuration (times in nanoseconds)."""

    max_batch_size: int
    timeout_ns: int
    preferred_batch_sizes: list[int]
    max_queue_size: int | None
    priority_levels: int
    default_timeout_ns: int | None
    timeout_action: TimeoutAction


class ContinuousSchedulerConfig(TypedDict):
    """The continuous scheduler's configuration (``ContinuousBatchScheduler.config``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    preemption: Preemption
    watermark: float


class SchedulerCounts(TypedDict):
    """``_core.ContinuousScheduler.counts()``: requests by state, preemptions so far, and
    what lower-tier loads did (requests whose loads started, blocks served, failed loads)."""

    waiting: int
    running: int
    swapped: int
    preemptions: int
    loading: int
    loads_started: int
    loaded_blocks: int
    load_failures: int


# ---- what the Python classes add ------------------------------------------------------------


class KVCachePoolStats(KVCacheStats):
    """``KVCachePool.stats()``: the core's, and where the bytes are."""

    device: str | None
    bytes_device: int
    bytes_host_tier: int


class ContinuousBatchSchedulerStats(SchedulerCounts):
    """``ContinuousBatchScheduler.stats()``."""

    finished: int
    last_batch_size: int
    last_batch_tokens: int


class DynamicBatchSchedulerConfig(TypedDict):
    """``DynamicBatchScheduler.config`` (times in milliseconds, as given)."""

    max_batch_size: int
    timeout_ms: float
    preferred_batch_sizes: tuple[int, ...]
    max_queue_size: int | None
    priority_levels: int
    default_timeout_ms: float | None
    timeout_action: TimeoutAction


class DynamicBatchSchedulerStats(TypedDict):
    """``DynamicBatchScheduler.stats()``."""

    queue_length: int
    batches: int
    requests_batched: int
    last_batch_size: int


class KVCacheGroup(NamedTuple):
    """Layers of one attention kind whose K/V share a block list per sequence.

    ``kind``: transformers' layer type (``"full_attention"``, ``"sliding_attention"``,
    ``"chunked_attention"``); ``layers``: the model layers in the group; ``window``: the
    sliding window or attention chunk in tokens (None for full attention)."""

    kind: str
    layers: tuple[int, ...]
    window: int | None


class StateGroup(NamedTuple):
    """Recurrent layers (transformers' ``"linear_attention"``: Mamba, gated delta-net) whose
    per-sequence states share blocks: layer ``layers[s]`` keeps its ``state_bytes`` in slot
    ``s`` of the group's ``num_blocks`` state blocks, which are columns ``first_column`` on of
    ``KVCachePool.state_table``."""

    layers: tuple[int, ...]
    state_bytes: int
    num_blocks: int
    first_column: int


MISS_REASONS = ("block_alignment", "not_cached", "evicted", "window", "state_checkpoint")
"""Why a prefix hit falls short, as ``stats()`` counts it: only block alignment stopped it;
the next block was never cached; it was evicted; a windowed group lacks a block inside the
window of the next hit point; a model with recurrent layers has no state checkpoint at the
end of a longer hit (the hit resumes from the last one the K/V reaches, or none).
``explain_prefix`` may also say ``"prefix_caching_off"``."""


class GroupPrefix(NamedTuple):
    """What one KV-cache group alone could serve of a prompt, and why it stops there."""

    group: int
    kind: str
    cached_tokens: int
    reason: str


class PrefixExplanation(NamedTuple):
    """``KVCachePool.explain_prefix``: the hit an admission would get now (every group can
    serve it), why it stops there and which group stops it (None: block alignment, or
    prefix caching off), and each group's own view."""

    hit_tokens: int
    reason: str
    limited_by: int | None
    groups: list[GroupPrefix]
    #: Where the hit comes from, in order: ``("device" | "host", tokens)`` runs summing to
    #: ``hit_tokens`` (host: promoted from the host prefix cache).
    tiers: list[tuple[str, int]]
    #: Of ``hit_tokens``, those past the last whole block: copied from a cached block that
    #: starts with them (``hash_block_size``); whole-block keys would recompute them.
    partial_tokens: int = 0
