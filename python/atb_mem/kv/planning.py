"""Sizing the KV cache from memory figures (the seeds' `gpu_memory_utilization` formulas)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from atb_mem._core import KV_DTYPES, kv_cache_groups, kv_layout_bytes
from atb_mem._types import KVCacheDtype

FRAME_BYTES = 16  # a stored block's header: atb_mem.kv.tiers.store.frame

__all__ = ["KV_DTYPES", "KVCachePlan", "block_bytes", "block_layout", "plan_kv_cache"]


@dataclass(frozen=True)
class KVCachePlan:
    """The result of :func:`plan_kv_cache`; every figure in bytes or blocks."""

    num_blocks: int
    bytes_per_block: int
    max_num_seqs: int
    usable_bytes: int
    bytes_per_seq: int
    blocks_per_seq: int
    num_groups: int = 1
    """KV-cache groups (``layer_types``); a block holds one group's layers."""
    block_size: int = 0
    num_host_blocks: int = 0
    """Blocks of the host offload tier (``host_offload_bytes``), 0 without one."""
    num_disk_blocks: int = 0
    """Blocks the disk tier holds (``disk_offload_bytes``; each file is a block and a
    16-byte header), 0 without one."""
    state_blocks_per_seq: int = 0
    """Of ``blocks_per_seq``, those of the recurrent layers' states (``state_bytes``), which a
    sequence holds whatever its length."""

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint of a sequence's recurrent states (what a hybrid model's
        prefix hit resumes from): ``state_blocks_per_seq`` cached blocks, kept at most once
        every ``state_checkpoint_interval`` blocks of a prefix. 0 without recurrent layers."""
        return self.state_blocks_per_seq * self.bytes_per_block

    def prefix_blocks(self, tokens: int, state_checkpoint_interval: int = 1) -> int:
        """Most blocks a cached prefix of ``tokens`` tokens takes: a block per group per
        ``block_size`` tokens, and with recurrent layers a checkpoint per
        ``state_checkpoint_interval`` blocks (1, the most)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        blocks = tokens // self.block_size
        checkpoints = blocks // _positive_int("state_checkpoint_interval",
                                              state_checkpoint_interval)
        return blocks * self.num_groups + checkpoints * self.state_blocks_per_seq

    @property
    def device_tokens(self) -> int:
        """Tokens of prefix the device's blocks hold (each token takes a block per group)."""
        return (self.num_blocks - 1) * self.block_size // self.num_groups

    @property
    def host_tokens(self) -> int:
        """Tokens of evicted prefix the host tier holds on top (see ``device_tokens``)."""
        return self.num_host_blocks * self.block_size // self.num_groups

    @property
    def disk_tokens(self) -> int:
        """Tokens of prefix the disk tier holds."""
        return self.num_disk_blocks * self.block_size // self.num_groups


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
                layer_types: Sequence[str] | None = None, sliding_window: int | None = None,
                attention_chunk_size: int | None = None, state_bytes: int | None = None,
                kv_cache_dtype: KVCacheDtype = "auto"
                ) -> tuple[int, list[tuple[str, list[int], int | None]]]:
    """(bytes of one block, the KV-cache groups) of the cache ``KVCachePool`` builds for these
    dimensions: a block holds the K/V of one group's ``layers_per_block`` layers."""
    per_block, groups, _ = block_layout(block_size, num_layers, num_kv_heads, head_dim, dtype,
                                        layer_types, sliding_window, attention_chunk_size,
                                        state_bytes, kv_cache_dtype)
    return per_block, groups


def block_layout(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: str, layer_types: Sequence[str] | None = None,
                 sliding_window: int | None = None, attention_chunk_size: int | None = None,
                 state_bytes: int | None = None, kv_cache_dtype: KVCacheDtype = "auto"
                 ) -> tuple[int, list[tuple[str, list[int], int | None]], int]:
    """``block_bytes`` and the blocks one sequence's recurrent states take: each state group
    takes ⌈state_bytes / one layer's share of a block⌉, as ``KVCachePool.state_groups``."""
    groups, layers_per_block, states = kv_cache_groups(num_layers, layer_types, sliding_window,
                                                       attention_chunk_size, state_bytes)
    per_block = kv_layout_bytes(layers_per_block, num_kv_heads, head_dim, dtype, block_size,
                                kv_cache_dtype)[2]
    slot_bytes = per_block // layers_per_block
    return per_block, groups, sum(-(-size // slot_bytes) for _, size in states)


def plan_kv_cache(total_bytes: int, model_bytes: int, *, gpu_memory_utilization: float = 0.85,
                  block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: str, max_model_len: int, safety: float = 0.9,
                  layer_types: Sequence[str] | None = None, sliding_window: int | None = None,
                  attention_chunk_size: int | None = None, state_bytes: int | None = None,
                  host_offload_bytes: int = 0, disk_offload_bytes: int = 0,
                  kv_cache_dtype: KVCacheDtype = "auto") -> KVCachePlan:
    """Sizes a KV cache, and the host offload tier of ``host_offload_bytes`` below it.

    The arithmetic:

    - ``usable = total_bytes × gpu_memory_utilization − model_bytes``: what the cache may use
      once the weights are loaded;
    - ``bytes_per_block = 2 (K and V) × num_layers × block_size × num_kv_heads × row``, a row
      being ``head_dim × itemsize(dtype)``, or with ``kv_cache_dtype`` ``"int8"`` or
      ``"fp8_e4m3"`` ``head_dim`` one-byte codes and their four-byte scale (docs/bytes.md);
    - ``num_blocks = ⌊usable / bytes_per_block⌋`` (block 0, the null block, included);
    - ``blocks_per_seq = ⌈max_model_len / block_size⌉`` and ``bytes_per_seq = blocks_per_seq ×
      bytes_per_block``: one sequence at the maximum length;
    - ``max_num_seqs = ⌊usable / bytes_per_seq × safety⌋``: how many such sequences fit, with a
      margin for activations and fragmentation;
    - ``num_host_blocks = ⌊host_offload_bytes / bytes_per_block⌋``: host blocks that keep the
      prefix blocks the device evicts (``Engine(kv_offload={"host": ...})``), and
      ``num_disk_blocks`` the disk tier's files (a block and its 16-byte frame each);
      ``device_tokens`` and ``host_tokens`` say how many tokens of prefix each tier holds.

    With ``layer_types`` (and ``sliding_window`` / ``attention_chunk_size``), layers form
    KV-cache groups as ``KVCachePool`` forms them: a block holds one group's
    ``layers_per_block`` layers, and a sequence costs a full-attention group
    ``⌈max_model_len / block_size⌉`` blocks but a windowed group only ``⌈window / block_size⌉
    + 1`` (never more than the full length). Recurrent (``"linear_attention"``) layers add
    their states' blocks (``state_bytes`` each layer) to every sequence.

    Refuses (``ValueError``) a utilization or safety outside (0, 1], a model that does not fit
    in ``total × utilization``, and a cache that cannot hold one max-length sequence besides
    the null block.
    """
    for name, value in (("total_bytes", total_bytes), ("model_bytes", model_bytes),
                        ("host_offload_bytes", host_offload_bytes),
                        ("disk_offload_bytes", disk_offload_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 bytes, got {value!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not 0 < safety <= 1:
        raise ValueError(f"safety must be in (0, 1], got {safety}")
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(KV_DTYPES)}")
    dims = {name: _positive_int(name, value) for name, value in (
        ("block_size", block_size), ("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim), ("max_model_len", max_model_len))}
    budget = int(total_bytes * gpu_memory_utilization)
    if model_bytes >= budget:
        raise ValueError(
            f"the model ({model_bytes} bytes) does not fit in {gpu_memory_utilization:.0%} of "
            f"{total_bytes} bytes ({budget} bytes): nothing is left for the KV cache"
        )
    usable = budget - model_bytes
    bytes_per_block, groups, state_blocks = block_layout(
        dims["block_size"], dims["num_layers"], dims["num_kv_heads"], dims["head_dim"], dtype,
        layer_types, sliding_window, attention_chunk_size, state_bytes, kv_cache_dtype)
    num_blocks = usable // bytes_per_block
    full_length = math.ceil(dims["max_model_len"] / dims["block_size"])
    blocks_per_seq = state_blocks + sum(full_length if window is None else
                                        min(full_length, math.ceil(window / dims["block_size"]) + 1)
                                        for _, _, window in groups)
    bytes_per_seq = blocks_per_seq * bytes_per_block
    if num_blocks - 1 < blocks_per_seq:
        raise ValueError(
            f"{usable} usable bytes make {num_blocks} blocks of {bytes_per_block} bytes, "
            f"fewer than one {dims['max_model_len']}-token sequence needs ({blocks_per_seq} "
            "blocks plus the null block)"
        )
    max_num_seqs = max(1, math.floor(usable / bytes_per_seq * safety))
    return KVCachePlan(num_blocks=num_blocks, bytes_per_block=bytes_per_block,
                       max_num_seqs=max_num_seqs, usable_bytes=usable,
                       bytes_per_seq=bytes_per_seq, blocks_per_seq=blocks_per_seq,
                       num_groups=len(groups), block_size=dims["block_size"],
                       state_blocks_per_seq=state_blocks,
                       num_host_blocks=host_offload_bytes // bytes_per_block,
                       num_disk_blocks=disk_offload_bytes // (bytes_per_block + FRAME_BYTES))
