"""What names a model's K/V in the tiers that engines share (disk, Mooncake): a digest of
every byte of its weights, or the name its user gives (``kv_identity``).

Two models with one config and one checkpoint path can still differ anywhere in their
weights (a fine-tune that changed one embedding row): only the bytes tell them apart. The
digest is the core's (``_core.content_digests``: BLAKE3 over 8 MiB pieces on every thread,
the GIL released), once at start-up; see ``benches/weights_digest.py`` for its speed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from atb_mem import _core

__all__ = ["checked_kv_identity", "weights_digest"]

# Bytes copied (off an accelerator, or made contiguous) before they are hashed and let go:
# bounds the host memory the digest of a model on a GPU takes.
_DEVICE_BATCH_BYTES = 1 << 30


def checked_kv_identity(kv_identity: object) -> str | None:
    """``kv_identity`` as given, refused unless ``None`` or a non-empty str."""
    if kv_identity is None:
        return None
    if not isinstance(kv_identity, str):
        raise TypeError(f"kv_identity must be a str naming the model's weights (e.g. "
                        f"'org/model@revision'), got {type(kv_identity).__name__}")
    if not kv_identity.strip():
        raise ValueError("kv_identity must name the model's weights (e.g. "
                         "'org/model@revision'), got an empty string")
    return kv_identity


def _named_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    # Persistent buffers too (quantization scales, a model's own tables: K/V inputs like
    # weights); not the ones derived from the config at load time (rotary tables), which
    # a run may recompute.
    yield from model.named_parameters()
    persistent = model.state_dict(keep_vars=True).keys()
    yield from ((name, buffer) for name, buffer in model.named_buffers() if name in persistent)


def weights_digest(model: Any, threads: int | None = None) -> str:
    """A hex digest of every byte of ``model``'s parameters and buffers, with their names,
    dtypes and shapes. ``threads``: torch's thread count by default."""
    import torch

    if threads is None:
        threads = torch.get_num_threads()
    digest = hashlib.sha256()
    headers: list[bytes] = []
    arrays: list[Any] = []
    copied = 0

    def flush() -> None:
        for header, part in zip(headers, _core.content_digests(arrays, threads), strict=True):
            digest.update(len(header).to_bytes(8, "little"))
            digest.update(header)
            digest.update(part)
        headers.clear()
        arrays.clear()

    with torch.no_grad():
        for name, tensor in _named_tensors(model):
            data = tensor.detach()
            if data.device.type == "meta":
                raise ValueError(f"the model's {name!r} is not loaded (on the meta device): "
                                 f"its weights cannot be read to key the tiers' blocks; load "
                                 f"them, or give kv_identity")
            if data.device.type != "cpu" or not data.is_contiguous():
                data = data.cpu().contiguous()
                copied += data.numel() * data.element_size()
            headers.append(f"{name}|{data.dtype}|{tuple(data.shape)}".encode())
            arrays.append(data.reshape(-1).view(torch.uint8).numpy())
            if copied >= _DEVICE_BATCH_BYTES:
                flush()
                copied = 0
    flush()
    return digest.hexdigest()
