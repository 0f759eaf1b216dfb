"""Where KV-cache bytes live: host memory through numpy (the default), or one torch tensor on
``cpu``, ``cuda[:N]`` or ``npu[:N]`` (torch-npu).

A backend owns nothing itself; it knows how to make a region of bytes for a ``MemPool``
(``HostRegion`` or ``TorchRegion``), the dtypes, and the few array operations the KV cache
needs, each one batched call whatever the number of blocks:

- ``copy_blocks(dst, dst_blocks, src, src_blocks)``: one indexed copy along the block axis,
  across tiers (device ↔ host) or within one;
- ``scatter(cache, slots, values)``: ATB's ReshapeAndCache, values into token slots
  (negative slots are padding).

Host memory (numpy, and CPU torch through numpy views of the same bytes) moves through the
extension's ``memcpy`` kernels, which copy each byte once; device memory through torch's
indexed copies.

torch is imported only when a torch device is asked for; ``"npu"`` imports torch_npu.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from atb_mem import _core
from atb_mem._types import BackendName

if TYPE_CHECKING:
    import torch

Bytes = npt.NDArray[np.uint8]

__all__ = ["NumpyBackend", "TorchBackend", "TorchRegion", "backend_for"]

# numpy has no bfloat16: the host backing holds its bits as uint16 words (view them with
# ml_dtypes' bfloat16, or use a torch device).
_NUMPY_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32,
                 "int8": np.int8, "uint8": np.uint8}


class NumpyBackend:
    """Host memory as numpy arrays."""

    name: BackendName = "numpy"
    device = "host"

    def region(self, nbytes: int) -> _core.HostRegion:
        return _core.HostRegion(nbytes, 4096)

    def dtype(self, name: str) -> Any:
        if name not in _NUMPY_DTYPES:
            raise ValueError(f"dtype {name!r} has no numpy type on the host backing")
        return np.dtype(_NUMPY_DTYPES[name])

    def host_tensor(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def is_tensor(self, value: object) -> bool:
        return isinstance(value, np.ndarray)

    def to_numpy(self, values: Any) -> np.ndarray:
        return np.asarray(values)

    def copy_blocks(self, dst: np.ndarray, dst_blocks: np.ndarray, src: np.ndarray,
                    src_blocks: np.ndarray) -> None:
        _host_copy_blocks(_bytes_of(dst), dst.shape, None if src is dst else _bytes_of(src),
                          src.shape, dst.itemsize, dst_blocks, src_blocks)

    def bytes_of(self, tensor: np.ndarray) -> Bytes:
        return _bytes_of(np.ascontiguousarray(tensor))

    def scatter_kv(self, kv: np.ndarray, kv_bytes: Bytes | None, layer: int, slots: np.ndarray,
                   key: np.ndarray, value: np.ndarray) -> None:
        assert kv_bytes is not None  # host memory always has them
        _host_scatter_kv(kv_bytes, tuple(kv.shape), kv.itemsize, layer, slots,
                         self.bytes_of(key), self.bytes_of(value))


class TorchRegion:
    """A MemPool backing made of one torch uint8 tensor on a device.

    The backing protocol: ``ptr`` (base address), ``nbytes``, ``view(offset, nbytes, dtype,
    shape)`` returning a tensor over those bytes, and ``itemsize(dtype)``.
    """

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        _require_torch(device)
        import torch

        # Zeroed once at start-up, like the host backing: stale bytes in a padded block can
        # otherwise turn into NaNs in kernels that read past a sequence.
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.device = str(self.tensor.device)

    @property
    def ptr(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    def itemsize(self, dtype: Any) -> int:
        return int(_torch_dtype(dtype).itemsize)

    def view(self, offset: int, nbytes: int, dtype: Any, shape: Any = None) -> Any:
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset}+{nbytes}) are outside the region")
        flat = self.tensor[offset:offset + nbytes].view(_torch_dtype(dtype))
        return flat if shape is None else flat.view(tuple(shape))

    def __repr__(self) -> str:
        return f"TorchRegion(nbytes={self.nbytes}, device={self.device!r})"


class TorchBackend:
    """One torch tensor on ``cpu``, ``cuda[:N]`` or ``npu[:N]``."""

    name: BackendName = "torch"

    def __init__(self, device: str) -> None:
        _require_torch(device)
        import torch

        self.torch = torch
        self.device = str(torch.device(device))

    def region(self, nbytes: int) -> TorchRegion:
        return TorchRegion(nbytes, self.device)

    def dtype(self, name: str) -> Any:
        return _torch_dtype(name)

    def host_tensor(self, shape: tuple[int, ...], dtype: Any) -> Any:
        # Pinned host memory lets device copies run asynchronously (CUDA only).
        pin = self.device.startswith("cuda")
        return self.torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin)

    def is_tensor(self, value: object) -> bool:
        return isinstance(value, self.torch.Tensor)

    def indices(self, values: np.ndarray, device: str | None = None) -> torch.Tensor:
        return self.torch.as_tensor(np.asarray(values, dtype=np.int64), device=device or "cpu")

    def to_numpy(self, values: Any) -> np.ndarray:
        if isinstance(values, self.torch.Tensor):
            return values.detach().to("cpu").numpy()
        return np.asarray(values)

    def bytes_of(self, tensor: torch.Tensor) -> Bytes | None:
        """The tensor's bytes as a flat numpy uint8 array (no copy); None off the host."""
        if tensor.device.type != "cpu":
            return None
        flat: Bytes = tensor.detach().contiguous().view(self.torch.uint8).numpy().reshape(-1)
        return flat

    def copy_blocks(self, dst: torch.Tensor, dst_blocks: np.ndarray, src: torch.Tensor,
                    src_blocks: np.ndarray) -> None:
        dst_bytes = self.bytes_of(dst)
        src_bytes = dst_bytes if src is dst else self.bytes_of(src)
        if dst_bytes is not None and src_bytes is not None:  # both on the host
            _host_copy_blocks(dst_bytes, tuple(dst.shape), None if src is dst else src_bytes,
                              tuple(src.shape), dst.element_size(), dst_blocks, src_blocks)
            return
        src_index = self.indices(src_blocks, str(src.device))
        dst_index = self.indices(dst_blocks, str(dst.device))
        with self.torch.no_grad():
            moved = src.index_select(2, src_index)
            if moved.device != dst.device:
                # Host-to-device may overlap with compute; device-to-host must have landed
                # before the host reads it.
                moved = moved.to(dst.device, non_blocking=dst.device.type != "cpu")
            dst.index_copy_(2, dst_index, moved)

    def scatter_kv(self, kv: torch.Tensor, kv_bytes: Bytes | None, layer: int,
                   slots: np.ndarray, key: torch.Tensor, value: torch.Tensor) -> None:
        if kv_bytes is not None:
            key_bytes, value_bytes = self.bytes_of(key), self.bytes_of(value)
            # write_kv let them through only on the cache's device: the host, here.
            assert key_bytes is not None and value_bytes is not None
            _host_scatter_kv(kv_bytes, tuple(kv.shape), kv.element_size(), layer, slots,
                             key_bytes, value_bytes)
            return
        keep = np.flatnonzero(slots >= 0)
        index = self.indices(slots[keep], str(kv.device))
        flat = (-1, kv.shape[4], kv.shape[5])
        with self.torch.no_grad():  # a cache is not part of any autograd graph
            for half, values in ((0, key), (1, value)):
                if len(keep) != len(slots):
                    values = values.index_select(0, self.indices(keep, str(kv.device)))
                kv[layer, half].view(flat).index_copy_(0, index, values)


def _bytes_of(array: np.ndarray) -> Bytes:
    """A contiguous array's bytes as a flat uint8 view (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("KV tensors must be contiguous")
    return array.reshape(-1).view(np.uint8)


def _host_copy_blocks(dst: Bytes, dst_shape: tuple[int, ...], src: Bytes | None,
                      src_shape: tuple[int, ...], itemsize: int, dst_blocks: np.ndarray,
                      src_blocks: np.ndarray) -> None:
    """Tiers shaped ``[layers, 2, blocks, *block]``: copy whole blocks for every layer."""
    chunk = int(np.prod(dst_shape[3:])) * itemsize
    pairs = np.stack([np.asarray(src_blocks), np.asarray(dst_blocks)], axis=1).astype(np.int32)
    _core.copy_blocks(dst, dst_shape[2], src, src_shape[2], chunk, pairs)


def _host_scatter_kv(kv_bytes: Bytes, kv_shape: tuple[int, ...], itemsize: int,
                     layer: int, slots: np.ndarray, key: Bytes, value: Bytes) -> None:
    """Tiers shaped ``[layers, 2, blocks, block_size, heads, head_dim]``: one layer's K and V
    rows (a row is one token's heads × head_dim) from ``key``/``value`` into ``slots``."""
    _, _, blocks, block_size, heads, head_dim = kv_shape
    row_bytes = heads * head_dim * itemsize
    half_bytes = blocks * block_size * row_bytes
    offsets = (2 * layer * half_bytes, (2 * layer + 1) * half_bytes)
    _core.scatter_rows(kv_bytes, row_bytes, blocks * block_size, slots,
                       [(offsets[0], key), (offsets[1], value)])


def _require_torch(device: str) -> None:
    """Raises ImportError, saying what to install, unless ``device`` can be used."""
    try:
        import torch  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"device {device!r} needs PyTorch: pip install 'atb-mem[torch]'"
        ) from error
    if str(device).startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        except ImportError as error:
            raise ImportError(
                f"device {device!r} needs torch-npu (Ascend): pip install torch-npu, "
                "matching your torch and CANN versions"
            ) from error


def _torch_dtype(dtype: Any) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    table = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
             "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
             "int64": torch.int64, "float64": torch.float64}
    if name not in table:
        raise ValueError(f"unsupported dtype {dtype!r} for a torch backing")
    return table[name]


def backend_for(device: str | torch.device) -> NumpyBackend | TorchBackend:
    """``"host"`` → numpy; ``"cpu"``, ``"cuda[:N]"``, ``"npu[:N]"`` → torch."""
    if not isinstance(device, str):
        device = str(device)  # a torch.device
    if device == "host":
        return NumpyBackend()
    if device == "cpu" or device.split(":")[0] in ("cuda", "npu"):
        return TorchBackend(device)
    raise ValueError(
        f"unknown device {device!r}: expected 'host', 'cpu', 'cuda', 'cuda:N', 'npu' or 'npu:N'"
    )
