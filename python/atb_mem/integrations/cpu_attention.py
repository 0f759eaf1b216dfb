"""atb-mem's own paged attention on the CPU: the core's Rust kernel over the KV cache's blocks.

One call per layer writes the step's new K/V into their slots and attends every row of the
step — decodes, first and later prefill chunks, prefix hits — reading K/V in place through the
group's block tables (no gather, no mask tensor): ATB's fused operator, for the device that has
none of its own. It computes every kind of layer the models here have: full, sliding-window
and chunked attention, grouped-query heads, gpt-oss's attention sinks; in float32, bfloat16 or
float16, on as many threads as torch uses, with the GIL released.

Tensors cross as numpy views of the same memory (16-bit ones as their int16 bits), so the
kernel needs CPU tensors; every input is checked by the core before anything is read.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from atb_mem import _core
from atb_mem.integrations.layer_attention import LayerAttention

if TYPE_CHECKING:
    import torch

__all__ = ["CpuPagedAttention", "CpuPagedStep", "share_torchs_threads"]

_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class CpuPagedAttention:
    """The kernel for one model's cache on the CPU: its block size and element type."""

    def __init__(self, block_size: int, dtype: Any) -> None:
        if str(dtype) not in _DTYPES:
            raise ValueError(f"the CPU kernel computes {sorted(_DTYPES.values())}, not {dtype}")
        self.block_size = block_size
        self.dtype = _DTYPES[str(dtype)]
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

    def attend(self, group: int, kind: LayerAttention, queries: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, scaling: float | None,
               sinks: torch.Tensor | None = None,
               new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``queries`` ``[T, H, D]`` of the step's tokens over the group's caches (``[slots,
        kv_heads, D]``), after writing ``new_kv`` (``[T, kv_heads, D]`` keys and values) into
        the step's slots; returns ``[T, H, D]``."""
        import torch

        queries = queries.contiguous()
        out = torch.empty_like(queries)
        scale = scaling if scaling is not None else queries.shape[-1] ** -0.5
        window = kind.window if kind.kind == "sliding_attention" and kind.window else None
        chunk = kind.window if kind.kind == "chunked_attention" and kind.window else None
        new: dict[str, Any] = {}
        if new_kv is not None:
            new = {"new_keys": _bits(new_kv[0].contiguous()),
                   "new_values": _bits(new_kv[1].contiguous()),
                   "slot_mapping": self.slot_planes[group]}
        _core.paged_attention(
            _bits(queries), _bits(key_cache), _bits(value_cache), _bits(out),
            self.query_start_loc, self.seq_lens, self.table_planes[group],
            block_size=self.kernel.block_size, scale=float(scale), dtype=self.kernel.dtype,
            window=window, chunk=chunk,
            sinks=None if sinks is None else sinks.detach().float().contiguous().numpy(),
            threads=self.threads, **new)
        return out


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory: float32 as such, 16-bit types as int16."""
    import torch

    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    return tensor.detach().numpy()


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
