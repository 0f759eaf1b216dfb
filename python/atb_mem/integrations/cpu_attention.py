"""atb-mem's own paged attention on the CPU: the core's Rust kernel over the KV cache's blocks.

One call per layer writes the step's new K/V into their slots and attends every row of the
step — decodes, first and later prefill chunks, prefix hits — reading K/V in place through the
group's block tables (no gather, no mask tensor): ATB's fused operator, for the device that has
none of its own. It computes every kind of layer the models here have: full, sliding-window
and chunked attention, grouped-query heads, gpt-oss's attention sinks; in float32, bfloat16 or
float16, on as many threads as torch uses, with the GIL released.

Tensors cross as numpy views of the same memory (16-bit ones as their int16 bits), so the
kernel needs CPU tensors; every input is checked by the core before anything is read.

One exception, measured: in bfloat16 on a CPU with AMX tiles, torch's SDPA (its flash
attention, on AMX) attends a row of many new tokens 3–4× faster than the kernel, which
computes in f32 (Qwen3-0.6B's heads, 256 new tokens: 0.66 against 2.2 ms; 256 after 256
cached: 2.0 against 7.8 ms, K/V gathered and a mask included). Such rows of
``SDPA_MIN_TOKENS`` new tokens or more go there, where SDPA computes exactly what the layer
asks (no sinks; a full layer, or a window the whole row fits in): a row whose K/V is all new
over the new K/V alone, causal; one with context over its K/V gathered from the cache, its
new tokens seeing the context and themselves causally. Decodes and shorter rows still take
the kernel, in one call, and every new K/V is written to its slot first. Over a quantized
cache the new K/V is quantized first and SDPA attends over what the rows read back as, fresh
rows and rows with context alike.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from atb_mem import _core
from atb_mem._types import KVCacheDtype
from atb_mem.integrations.layer_attention import LayerAttention
from atb_mem.integrations.reference_attention import sdpa_attention
from atb_mem.kv.quantized_rows import dequantize_tensor_rows, quantize_host_rows

if TYPE_CHECKING:
    import torch

__all__ = ["CORE_DTYPES", "SDPA_MIN_TOKENS", "CpuPagedAttention", "CpuPagedStep",
           "numpy_bits", "share_torchs_threads", "torch_cpu_has"]

CORE_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16",
               "torch.float16": "float16"}
"""torch's dtypes the core's kernels compute, by name, and the core's names for them."""

SDPA_MIN_TOKENS = 16
"""The shortest all-new row given to torch's SDPA (where it is used at all, see above)."""


class CpuPagedAttention:
    """The kernel for one model's cache on the CPU: its block size and element type."""

    def __init__(self, block_size: int, dtype: Any, kv_cache_dtype: KVCacheDtype = "auto"
                 ) -> None:
        if str(dtype) not in CORE_DTYPES:
            raise ValueError(f"the CPU kernel computes {sorted(CORE_DTYPES.values())}, "
                             f"not {dtype}")
        self.block_size = block_size
        self.dtype = CORE_DTYPES[str(dtype)]
        self.kv_cache_dtype = kv_cache_dtype
        """``"auto"`` (the caches hold ``dtype``) or a quantized cache's rows, read in place."""
        # Over a quantized cache SDPA reads what the rows read back as (dequantized), fresh
        # rows and rows with context alike, so that a hit computes what a recompute does.
        amx = torch_cpu_has("amx_tile")
        self.sdpa_min_tokens = SDPA_MIN_TOKENS if self.dtype == "bfloat16" and amx else None
        """Fresh rows of at least this many tokens go to torch's SDPA (None: none do)."""
        share_torchs_threads()

    @staticmethod
    def serves(kind: LayerAttention, sinks: Any) -> bool:
        """Every attention layer (a recurrent one has no K/V to attend)."""
        return not kind.is_recurrent

    def begin_step(self, query_lens: np.ndarray, seq_lens: np.ndarray, table_planes: np.ndarray,
                   slot_planes: np.ndarray) -> CpuPagedStep:
        """``table_planes`` ``[groups, rows, width]`` and ``slot_planes`` ``[groups, tokens]``:
        the step plan's block tables and slots."""
        import torch

        starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        return CpuPagedStep(self, starts, np.ascontiguousarray(seq_lens, dtype=np.int32),
                            np.ascontiguousarray(table_planes, dtype=np.int32),
                            np.ascontiguousarray(slot_planes, dtype=np.int32),
                            torch.get_num_threads())


@dataclass(frozen=True)
class CpuPagedStep:
    """One step's rows, shared by every layer."""

    kernel: CpuPagedAttention
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    table_planes: np.ndarray
    """``[groups, rows, width]``: the rows' block tables."""
    slot_planes: np.ndarray
    """``[groups, tokens]``: every token's slot."""
    threads: int
    splits: dict[tuple[int, LayerAttention], _Split | None] = field(
        default_factory=dict, init=False)
    """Per group and kind of layer, which rows SDPA takes (None: the kernel takes all)."""
    arguments: dict[LayerAttention, dict[str, Any]] = field(default_factory=dict, init=False)
    """Per kind of layer, the kernel's arguments every such layer passes."""

    def attend(self, group: int, kind: LayerAttention, queries: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, scaling: float | None,
               sinks: torch.Tensor | None = None,
               new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``queries`` ``[T, H, D]`` of the step's tokens over the group's caches (``[slots,
        kv_heads, D]``), after writing ``new_kv`` (``[T, kv_heads, D]`` keys and values) into
        the step's slots; returns ``[T, H, D]``."""
        import torch

        if sinks is None and new_kv is not None and self.kernel.sdpa_min_tokens is not None:
            split = self._split(group, kind)
            if split is not None:
                return self._attend_split(split, group, kind, queries,
                                          (key_cache, value_cache), scaling, new_kv)
        queries = queries.contiguous()
        out = torch.empty_like(queries)
        scale = scaling if scaling is not None else queries.shape[-1] ** -0.5
        new_keys = new_values = slot_mapping = None
        if new_kv is not None:
            new_keys, new_values = (numpy_bits(part.contiguous()) for part in new_kv)
            slot_mapping = self.slot_planes[group]
        _core.paged_attention(
            numpy_bits(queries), numpy_bits(key_cache), numpy_bits(value_cache),
            numpy_bits(out),
            self.query_start_loc, self.seq_lens, self.table_planes[group], scale=float(scale),
            sinks=None if sinks is None else sinks.detach().float().contiguous().numpy(),
            new_keys=new_keys, new_values=new_values, slot_mapping=slot_mapping,
            **self._layer_arguments(kind))
        return out

    def _layer_arguments(self, kind: LayerAttention) -> dict[str, Any]:
        """The kernel's arguments that are the same for every layer of ``kind`` (built once a
        step: a layer's call is on a decode's critical path)."""
        arguments = self.arguments.get(kind)
        if arguments is None:
            window = kind.window if kind.kind == "sliding_attention" and kind.window else None
            chunk = kind.window if kind.kind == "chunked_attention" and kind.window else None
            arguments = {"block_size": self.kernel.block_size, "dtype": self.kernel.dtype,
                         "window": window, "chunk": chunk, "threads": self.threads,
                         "kv_cache_dtype": self.kernel.kv_cache_dtype}
            self.arguments[kind] = arguments
        return arguments

    def _split(self, group: int, kind: LayerAttention) -> _Split | None:
        """Which rows SDPA attends for layers of ``kind`` in ``group``, built on first use."""
        key = (group, kind)
        if key not in self.splits:
            self.splits[key] = _Split.of(self, group, kind)
        return self.splits[key]

    def _attend_split(self, split: _Split, group: int, kind: LayerAttention,
                      queries: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor],
                      scaling: float | None, new_kv: tuple[torch.Tensor, torch.Tensor]
                      ) -> torch.Tensor:
        """``attend`` with the split's fresh rows on SDPA, the rest on the kernel."""
        import torch

        (key_cache, value_cache), (new_keys, new_values) = caches, new_kv
        quantized = self.kernel.kv_cache_dtype
        if quantized != "auto":
            new_keys, new_values = (torch.from_numpy(quantize_host_rows(
                part.float().numpy(), quantized, self.threads)) for part in new_kv)
        key_cache.index_copy_(0, split.slots, new_keys)
        value_cache.index_copy_(0, split.slots, new_values)
        out = torch.empty(queries.shape, dtype=queries.dtype)
        for (start, end), context in zip(split.sdpa_rows, split.contexts, strict=True):
            if context is None:
                key, value = new_keys[start:end], new_values[start:end]
            else:
                key, value = key_cache[context.slots], value_cache[context.slots]
            if quantized != "auto":
                key, value = (dequantize_tensor_rows(part, quantized).to(queries.dtype)
                              for part in (key, value))
            query, key, value = (part.transpose(0, 1)[None]  # [1, heads, t, D]
                                 for part in (queries[start:end], key, value))
            mask = None if context is None else context.mask
            attended = sdpa_attention(query, key, value, mask, scaling, None)
            out[start:end] = attended[0].transpose(0, 1)
        if split.rest is not None:
            # The kernel's rows as a step of their own (one group's plane; slots written).
            rest = split.rest.attend(0, kind, queries.index_select(0, split.rest_tokens),
                                     key_cache, value_cache, scaling)
            out.index_copy_(0, split.rest_tokens, rest)
        return out


@dataclass(frozen=True)
class _Split:
    """A step's rows for one group and kind of layer: the fresh ones SDPA attends
    (``sdpa_rows``, token ranges) and the others as a step of their own for the kernel
    (``rest``, over the step's tokens ``rest_tokens``, gathered in order)."""

    slots: torch.Tensor
    """int64 ``[tokens]``: where every new K/V goes."""
    sdpa_rows: list[tuple[int, int]]
    contexts: list[_Context | None]
    """Per SDPA row, its K/V's slots and mask where it has context (None: all new)."""
    rest: CpuPagedStep | None
    rest_tokens: torch.Tensor

    @classmethod
    def of(cls, step: CpuPagedStep, group: int, kind: LayerAttention) -> _Split | None:
        import torch

        minimum = step.kernel.sdpa_min_tokens
        slots = step.slot_planes[group]
        # Full and sliding layers (chunked ones are not measured here).
        if minimum is None or not len(slots) or slots.min() < 0 or \
                kind.kind not in ("full_attention", "sliding_attention"):
            return None
        starts = step.query_start_loc
        query_lens = np.diff(starts)
        # SDPA computes the layer as it is where its window masks nothing of the row.
        to_sdpa = (query_lens >= minimum) & (step.seq_lens <= kind.unmasked_length)
        if not to_sdpa.any():
            return None
        rows = np.flatnonzero(~to_sdpa)
        tokens = np.flatnonzero(np.repeat(~to_sdpa, query_lens))
        rest = step.kernel.begin_step(query_lens[rows], step.seq_lens[rows],
                                      step.table_planes[group:group + 1, rows],
                                      step.slot_planes[group:group + 1, tokens]) \
            if len(rows) else None
        sdpa = np.flatnonzero(to_sdpa)
        return cls(slots=torch.from_numpy(slots.astype(np.int64)),
                   sdpa_rows=[(int(starts[row]), int(starts[row + 1])) for row in sdpa],
                   contexts=[_Context.of(step, group, int(row)) for row in sdpa],
                   rest=rest, rest_tokens=torch.from_numpy(tokens))


@dataclass(frozen=True)
class _Context:
    """A row with context, for SDPA: the slots of its positions ``0..seq_len`` and its
    mask (``[new, seq_len]``: each new token sees the context and the new tokens up to
    itself)."""

    slots: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, step: CpuPagedStep, group: int, row: int) -> _Context | None:
        import torch

        length = int(step.seq_lens[row])
        new = int(step.query_start_loc[row + 1] - step.query_start_loc[row])
        if new == length:
            return None
        block_size = step.kernel.block_size
        positions = np.arange(length)
        table = step.table_planes[group, row]
        slots = table[positions // block_size].astype(np.int64) * block_size \
            + positions % block_size
        mask = torch.ones((new, length), dtype=torch.bool).tril(length - new)
        return cls(slots=torch.from_numpy(slots), mask=mask)


def torch_cpu_has(feature: str) -> bool:
    """Whether this CPU has ``feature`` (``"amx_tile"``, ``"avx512_bf16"``, ...) for torch's
    kernels, by torch's own private test ``torch.cpu._is_<feature>_supported``; False where
    this torch has no such test."""
    import torch

    test = getattr(torch.cpu, f"_is_{feature}_supported", None)
    return bool(test and test())


def numpy_bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory: float32 as such, 16-bit types as int16."""
    import torch

    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    # detach() only where autograd records: it costs as much as numpy() itself, per tensor
    # and call (six a layer).
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


@functools.cache
def share_torchs_threads() -> str | None:
    """Runs the kernel's threads on the team of torch's own OpenMP runtime
    (``_core.use_openmp``); returns the path of the torch library it was found through, or
    None where torch has no OpenMP runtime to share (the kernel keeps a pool of its own).
    Torch's threads spin for a while after each operator: a pool beside them would share the
    cores with spinning threads. The runtime is looked up through ``libtorch_cpu``, so it is
    the one torch binds to, wherever its wheel or environment put it."""
    import torch

    if not torch.backends.openmp.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        # Paths are bytes to the kernel: surrogateescape keeps any of them readable.
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as maps:
            paths = {line.split(maxsplit=5)[-1].rstrip("\n") for line in maps
                     if line.count(" ") >= 5}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        if os.path.basename(path) != "libtorch_cpu.so":
            continue
        try:
            _core.use_openmp(path)
            return path
        except ValueError as error:
            warnings.warn(f"the CPU attention keeps threads of its own: {error}", stacklevel=2)
    return None
