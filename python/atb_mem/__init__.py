"""atb-mem: the KV-cache memory layer of an LLM inference server.

Fixed-size KV-cache blocks handed to sequences on demand (paged attention), with prefix
caching, copy-on-write forks, and block tables / slot mappings in the layout ATB's
PagedAttention and vLLM's kernels read. The core is Rust; this package is its Python face.
"""

from atb_mem import acl, attention, backends
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
    RequestTimeoutError,
    UnknownSequenceError,
    __version__,
)
from atb_mem.batching import Batch, DynamicBatchScheduler
from atb_mem.kv_cache import KVCachePool
from atb_mem.kv_tensors import KVTensors
from atb_mem.mem_pool import MemPool
from atb_mem.planning import KVCachePlan, plan_kv_cache
from atb_mem.scheduling import ContinuousBatchScheduler, StepPlan

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
    "RequestTimeoutError",
    "StepPlan",
    "UnknownSequenceError",
    "__version__",
    "acl",
    "attention",
    "backends",
    "plan_kv_cache",
]
