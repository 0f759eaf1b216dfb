"""The K/V bytes of a ``KVCachePool`` and the one way they move: ``execute(moves)``.

The core decides which blocks hold what and returns every block move it decides as one
ordered int32 ``[k, 3]`` array of (kind, source, destination); ``KVTensors`` executes it, in
that order, each run of same-kind moves as one batched copy. Its caller (the pool) holds the
pool's lock throughout, and commits or rolls back depending on whether this raised.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from atb_mem.memory.backends import NumpyBackend, TorchBackend

__all__ = ["MOVE_COPY", "MOVE_TO_DEVICE", "MOVE_TO_HOST", "KVTensors"]

# Move kinds, as the core numbers them.
MOVE_COPY, MOVE_TO_HOST, MOVE_TO_DEVICE = 0, 1, 2


class KVTensors:
    """The device tier ``kv`` (``[num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim]``) and, optionally, a host tier shaped alike, over one backend."""

    __slots__ = ("backend", "host_kv", "kv", "kv_bytes")

    def __init__(self, backend: NumpyBackend | TorchBackend, kv: Any, host_kv: Any = None) -> None:
        self.backend = backend
        self.kv = kv
        self.host_kv = host_kv
        # The region's bytes as one flat uint8 view, for the host copy kernels (None on a
        # device the host cannot address).
        self.kv_bytes = backend.bytes_of(kv)

    def execute(self, moves: np.ndarray) -> None:
        """Executes block moves in order. If a copy raises, the exception carries
        ``moves_attempted``: how many leading moves may have written their destinations."""
        moves = self._checked(moves)
        start = 0
        while start < len(moves):
            end = _run_end(moves, start)
            kind, run = int(moves[start, 0]), moves[start:end]
            try:
                self._copy_run(kind, run[:, 1], run[:, 2])
            except BaseException as error:
                error.moves_attempted = end  # type: ignore[attr-defined]
                raise
            start = end

    def _checked(self, moves: npt.ArrayLike) -> np.ndarray:
        """``moves`` as int ``[k, 3]``, every kind known and block in range — checked before
        anything is copied, so a bad list moves nothing."""
        moves = np.asarray(moves)
        if moves.ndim != 2 or moves.shape[1] != 3 or moves.dtype.kind not in "iu":
            raise ValueError(f"moves must be an integer [k, 3] array of (kind, src, dst), got "
                             f"{moves.dtype} with shape {moves.shape}")
        device = self.kv.shape[2]
        host = 0 if self.host_kv is None else self.host_kv.shape[2]
        for kind, src_blocks, dst_blocks in ((MOVE_COPY, device, device),
                                             (MOVE_TO_HOST, device, host),
                                             (MOVE_TO_DEVICE, host, device)):
            of_kind = moves[moves[:, 0] == kind]
            for column, blocks, tier in ((1, src_blocks, "source"), (2, dst_blocks, "destination")):
                bad = (of_kind[:, column] < 0) | (of_kind[:, column] >= blocks)
                if bad.any():
                    raise ValueError(f"a {tier} block {int(of_kind[bad][0, column])} of a move of "
                                     f"kind {kind} is outside its tier's {blocks} blocks")
        unknown = ~np.isin(moves[:, 0], (MOVE_COPY, MOVE_TO_HOST, MOVE_TO_DEVICE))
        if unknown.any():
            raise ValueError(f"unknown block move kind {int(moves[unknown][0, 0])}")
        return moves

    def _copy_run(self, kind: int, src: np.ndarray, dst: np.ndarray) -> None:
        if kind == MOVE_COPY:
            self.backend.copy_blocks(self.kv, dst, self.kv, src)
        elif kind == MOVE_TO_HOST:
            self.backend.copy_blocks(self._host(), dst, self.kv, src)
        elif kind == MOVE_TO_DEVICE:
            self.backend.copy_blocks(self.kv, dst, self._host(), src)
        else:
            raise ValueError(f"unknown block move kind {kind}")

    def _host(self) -> Any:
        if self.host_kv is None:
            raise ValueError("this KV cache has no host tier: construct it with num_host_blocks")
        return self.host_kv

    def scatter_kv(self, layer: int, slots: np.ndarray, key: Any, value: Any) -> None:
        """One layer's new K/V rows into their slots (negative slots are padding)."""
        self.backend.scatter_kv(self.kv, self.kv_bytes, layer, slots.astype(np.int64, copy=False),
                                key, value)


def _run_end(moves: np.ndarray, start: int) -> int:
    """End of the run of moves from ``start`` that one batched copy may execute: same kind,
    and no move reading or rewriting a block an earlier move of the run wrote (a batched
    copy reads every source before it writes; a copy-on-write of a copy-on-write does
    that)."""
    kind = moves[start, 0]
    written = {int(moves[start, 2])}
    end = start + 1
    while end < len(moves) and moves[end, 0] == kind:
        src, dst = int(moves[end, 1]), int(moves[end, 2])
        if (kind == MOVE_COPY and src in written) or dst in written:
            break
        written.add(dst)
        end += 1
    return end
