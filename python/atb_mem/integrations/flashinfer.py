"""FlashInfer's paged-attention kernel over atb-mem's KV cache (CUDA).

The cache already holds each layer's K/V as FlashInfer's ``NHD`` pages (``[num_blocks,
block_size, num_kv_heads, head_dim]``), so the kernel reads the blocks where they are; what it
needs per step is the page table in CSR form (:class:`PageTable`). One
``BatchPrefillWithPagedKVCacheWrapper`` per (KV-cache group, kind of layer) is planned once a
step, by the first layer that needs it, and run by every layer of that kind; prefill chunks and
decodes go through the same call.

A sliding-window group's table starts with null blocks where the window released pages. They
are left out of the CSR: dropping whole leading pages shortens a row's K/V and moves its
queries by the same amount (FlashInfer aligns a row's queries with the end of its K/V), so the
causal mask and the window (``window_left = W - 1``: transformers' window counts the query's
own position) are unchanged, and the null block is never read.

Layers FlashInfer does not compute as the model does — chunked-local attention, gpt-oss's
attention sinks — keep the torch reference in ``atb_mem.integrations.transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from atb_mem.integrations.layer_attention import LayerAttention

if TYPE_CHECKING:
    import torch

__all__ = ["FlashInferAttention", "FlashInferStep", "PageTable"]

WORKSPACE_BYTES = 128 << 20
"""FlashInfer's float workspace (split-K partial results), shared by the wrappers: they run one
after another on one stream. 128 MiB is what FlashInfer's examples and vLLM allocate."""

_NULL_BLOCK = 0


@dataclass(frozen=True)
class PageTable:
    """FlashInfer's CSR page table of a step's rows in one KV-cache group, all int32."""

    qo_indptr: np.ndarray
    """``[rows + 1]``: row ``r``'s new tokens are ``qo_indptr[r]:qo_indptr[r + 1]``."""
    kv_indptr: np.ndarray
    """``[rows + 1]``: row ``r``'s pages are ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``."""
    kv_indices: np.ndarray
    """The pages (blocks) each row attends, in order."""
    kv_last_page_len: np.ndarray
    """``[rows]``: the tokens in each row's last page (1 to block_size)."""

    @classmethod
    def from_plan(cls, query_lens: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray,
                  block_size: int) -> PageTable:
        """``tables``: ``[rows, width]`` block tables of the rows in one group; the blocks a
        row reads are the ``ceil(seq_len / block_size)`` first, less leading null blocks."""
        query_lens = np.asarray(query_lens, dtype=np.int64)
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        pages = -(-seq_lens // block_size)
        live = (np.arange(tables.shape[1])[None, :] < pages[:, None]) & (tables != _NULL_BLOCK)
        counts = live.sum(axis=1)
        first = live.argmax(axis=1)
        broken = (counts == 0) | (first + counts != pages)
        if broken.any():
            row = int(np.flatnonzero(broken)[0])
            raise ValueError(f"row {row}: the blocks of its {seq_lens[row]} tokens are not a run "
                             f"of live blocks after released ones: {tables[row].tolist()}")

        def indptr(lengths: np.ndarray) -> np.ndarray:
            out = np.zeros(len(lengths) + 1, dtype=np.int32)
            np.cumsum(lengths, out=out[1:])
            return out

        return cls(qo_indptr=indptr(query_lens), kv_indptr=indptr(counts),
                   kv_indices=tables[live].astype(np.int32),
                   kv_last_page_len=(seq_lens - (pages - 1) * block_size).astype(np.int32))


class FlashInferAttention:
    """FlashInfer's batch prefill wrapper per (group, kind of layer), for one model's cache."""

    def __init__(self, flashinfer: Any, device: Any, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: Any) -> None:
        import torch

        self.flashinfer = flashinfer
        self.device = torch.device(device)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrappers: dict[tuple[int, LayerAttention], Any] = {}

    @staticmethod
    def serves(kind: LayerAttention, sinks: Any) -> bool:
        """Whether the kernel computes this layer as transformers does."""
        return kind.kind != "chunked_attention" and sinks is None

    def wrapper(self, group: int, kind: LayerAttention) -> Any:
        key = (group, kind)
        if key not in self.wrappers:
            self.wrappers[key] = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD")
        return self.wrappers[key]

    def begin_step(self, query_lens: np.ndarray, seq_lens: np.ndarray,
                   table_planes: np.ndarray, slot_planes: np.ndarray) -> FlashInferStep:
        """``table_planes``: ``[groups, rows, width]``, the step plan's block tables (the
        slots are written before the kernel runs)."""
        return FlashInferStep(self, query_lens, seq_lens, table_planes)

    def probe(self) -> None:
        """Runs the kernel once on one page, so a dtype, head size or GPU it was not built for
        fails here, at start-up, rather than in the first step."""
        import torch

        shape = (2 * self.block_size, self.num_kv_heads, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        query = torch.zeros((1, self.num_heads, self.head_dim), dtype=self.dtype,
                            device=self.device)
        step = self.begin_step(np.array([1]), np.array([1]), np.array([[[1]]], dtype=np.int32),
                               np.array([[self.block_size]], dtype=np.int32))
        out = step.attend(0, LayerAttention(), query, keys, keys, None)
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError("FlashInfer returned non-finite attention over zero K/V")


@dataclass
class FlashInferStep:
    """One step's page tables and planned wrappers; built per step, used by every layer."""

    kernel: FlashInferAttention
    query_lens: np.ndarray
    seq_lens: np.ndarray
    table_planes: np.ndarray
    planned: dict[tuple[int, LayerAttention], tuple[Any, float | None]] = field(
        default_factory=dict)

    def attend(self, group: int, kind: LayerAttention, queries: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """``queries`` ``[T, H, D]`` of the step's tokens over the K/V already written to the
        group's slots (``[slots, kv_heads, D]``); returns ``[T, H, D]``."""
        pages = (-1, self.kernel.block_size, *key_cache.shape[1:])
        key_cache, value_cache = key_cache.view(pages), value_cache.view(pages)
        key = (group, kind)
        planned = self.planned.get(key)
        if planned is None or planned[1] != scaling:
            planned = (self._plan(group, kind, scaling), scaling)
            self.planned[key] = planned
        wrapper = planned[0]
        out: torch.Tensor = wrapper.run(queries.contiguous(), (key_cache, value_cache))
        return out

    def _plan(self, group: int, kind: LayerAttention, scaling: float | None) -> Any:
        import torch

        kernel = self.kernel
        table = PageTable.from_plan(self.query_lens, self.seq_lens, self.table_planes[group],
                                    kernel.block_size)

        def host(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array)

        wrapper = kernel.wrapper(group, kind)
        window_left = -1 if kind.window is None or kind.is_full else kind.window - 1
        # indptrs and last-page lengths from the host (planning reads them there: no sync);
        # the page indices are read by the kernel, on the device.
        wrapper.plan(host(table.qo_indptr), host(table.kv_indptr),
                     host(table.kv_indices).to(kernel.device, non_blocking=True),
                     host(table.kv_last_page_len), kernel.num_heads, kernel.num_kv_heads,
                     kernel.head_dim, kernel.block_size, causal=True, sm_scale=scaling,
                     window_left=window_left,
                     q_data_type=kernel.dtype, kv_data_type=kernel.dtype)
        return wrapper
