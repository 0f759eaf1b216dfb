"""atb-mem: the KV-cache memory layer of an LLM inference server.

Fixed-size KV-cache blocks handed to sequences on demand (paged attention), with prefix
caching, copy-on-write forks, and block tables / slot mappings in the layout ATB's
PagedAttention and vLLM's kernels read. The core is Rust; this package is its Python face:

- ``atb_mem.memory``: ``MemPool``, the CANN-named ``acl`` functions, the byte backings;
- ``atb_mem.kv``: ``KVCachePool``, its bytes (``KVTensors``), ``plan_kv_cache``, attention;
- ``atb_mem.scheduling``: ``ContinuousBatchScheduler`` and ``DynamicBatchScheduler``;
- ``atb_mem.events``: KV-cache events for KV-aware routers, vLLM's and Dynamo's formats;
- ``atb_mem.serving``: ``Engine`` over a transformers model, the OpenAI-compatible server;
- ``atb_mem.distributed``: tensor parallelism over torch.distributed (needs torch);
- ``atb_mem.observability``: the Prometheus collector (optional: ``prometheus_client``);
- ``atb_mem.tools``: the ``atb-mem`` command, never imported from here.

Every public class is importable from ``atb_mem`` itself.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from atb_mem._core import (
    NULL_BLOCK,
    PAD_SLOT,
    Allocation,
    AtbMemError,
    BatchTable,
    BlockMoveError,
    DuplicateSequenceError,
    HostRegion,
    InvalidHandleError,
    OutOfMemoryError,
    QueueFullError,
    RequestRefusedError,
    RequestTimeoutError,
    UnknownSequenceError,
    __version__,
)
from atb_mem.kv.cache_pool import KVCachePool
from atb_mem.kv.planning import KVCachePlan, plan_kv_cache
from atb_mem.kv.tensors import KVTensors
from atb_mem.memory.mem_pool import MemPool
from atb_mem.scheduling.continuous import ContinuousBatchScheduler, StepPlan
from atb_mem.scheduling.request_batching import Batch, DynamicBatchScheduler

if TYPE_CHECKING:
    from atb_mem.kv import attention as attention
    from atb_mem.memory import acl as acl
    from atb_mem.memory import backends as backends
    from atb_mem.observability import metrics as metrics

# Modules reachable as attributes of the package, imported on first use (PEP 562): metrics
# needs the optional prometheus_client, and nobody should pay for a module they never touch.
_LAZY_MODULES = {
    "acl": "atb_mem.memory.acl",
    "attention": "atb_mem.kv.attention",
    "backends": "atb_mem.memory.backends",
    "metrics": "atb_mem.observability.metrics",
}


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY_MODULES:
        module = importlib.import_module(_LAZY_MODULES[name])
        globals()[name] = module  # later lookups skip this function
        return module
    raise AttributeError(f"module 'atb_mem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_MODULES})


__all__ = [
    "NULL_BLOCK",
    "PAD_SLOT",
    "Allocation",
    "AtbMemError",
    "Batch",
    "BatchTable",
    "BlockMoveError",
    "ContinuousBatchScheduler",
    "DuplicateSequenceError",
    "DynamicBatchScheduler",
    "HostRegion",
    "InvalidHandleError",
    "KVCachePlan",
    "KVCachePool",
    "KVTensors",
    "MemPool",
    "OutOfMemoryError",
    "QueueFullError",
    "RequestRefusedError",
    "RequestTimeoutError",
    "StepPlan",
    "UnknownSequenceError",
    "__version__",
    "acl",
    "attention",
    "backends",
    "plan_kv_cache",
]
