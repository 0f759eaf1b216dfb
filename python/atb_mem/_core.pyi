"""Stubs of the Rust extension ``atb_mem._core``, kept in sync by tests/package/test_stubs.py."""

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, final, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

from atb_mem._types import (
    AlignmentPolicy,
    ContinuousSchedulerConfig,
    KVCacheDtype,
    KVCacheStats,
    KVDtype,
    KVDtypeAlias,
    LiveAllocation,
    MemoryBacking,
    MemPoolStats,
    RequestBatcherConfig,
    SchedulerCounts,
)
from atb_mem.events import KVCacheEvent

__version__: str
NULL_BLOCK: int
"""Block 0: owned by no sequence; block tables are padded with it."""
PAD_SLOT: int
"""-1: slot-mapping entry of a batch-table row with no new token (kernels skip it)."""
KV_DTYPES: list[KVDtype]
"""The dtypes a KV cache takes, by canonical name."""
KV_CACHE_DTYPES: list[KVCacheDtype]
"""The ``kv_cache_dtype`` names a KV cache takes: ``"auto"`` and the quantized ones."""
EVICTION_POLICIES: tuple[str, ...]
"""The names ``KVCachePool``'s ``eviction_policy`` takes, the core's one list of them."""
def kv_layout_bytes(num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: KVDtype | KVDtypeAlias | Any, block_size: int,
                    kv_cache_dtype: KVCacheDtype = "auto") -> tuple[int, int, int]:
    """(itemsize, K+V bytes per token, per block) over every layer: sizes come from the core
    (a quantized cache's rows count their scales)."""
def quantize_kv_rows(values: npt.NDArray[np.float32], out: npt.NDArray[np.uint8],
                     kv_cache_dtype: KVCacheDtype, *, threads: int = 1) -> None:
    """Writes each row of ``values`` (float32 ``[n, head_dim]``, C-contiguous) into ``out``
    (uint8 ``[n, head_dim + 4]``) as a quantized row: its one-byte codes, then its scale
    (int8: bfloat16 scale and offset; fp8_e4m3: an f32 scale), on ``threads`` threads (1 to
    1,024; those of ``paged_attention``). A row that is not all finite reads back as NaN."""
def dequantize_kv_rows(rows: npt.NDArray[np.uint8], out: npt.NDArray[np.float32],
                       kv_cache_dtype: KVCacheDtype) -> None:
    """Reads each quantized row of ``rows`` (uint8 ``[n, head_dim + 4]``) into ``out``
    (float32 ``[n, head_dim]``)."""
def kv_cache_groups(num_layers: int, layer_types: Sequence[str] | None = None,
                    sliding_window: int | None = None, attention_chunk_size: int | None = None,
                    state_bytes: int | None = None,
                    ) -> tuple[list[tuple[str, list[int], int | None]], int,
                               list[tuple[list[int], int]]]:
    """The KV-cache groups ``KVCachePool`` makes of these layers, layers per block, and the
    recurrent layers' state groups as ``(layers, state_bytes)``."""
def content_digests(buffers: Sequence[npt.NDArray[np.uint8]], threads: int = 0) -> list[bytes]:
    """The 32-byte BLAKE3 content digest of each contiguous uint8 array, hashed in 8 MiB
    pieces on ``threads`` threads (0: every core) with the GIL released; the same whatever
    the thread count."""

def paged_attention(query: npt.NDArray[Any], key_cache: npt.NDArray[Any],
                    value_cache: npt.NDArray[Any], out: npt.NDArray[Any],
                    query_start_loc: npt.NDArray[np.int32], seq_lens: npt.NDArray[np.int32],
                    block_tables: npt.NDArray[np.int32], *, block_size: int, scale: float,
                    dtype: str, window: int | None = None, chunk: int | None = None,
                    sinks: npt.NDArray[np.float32] | None = None,
                    new_keys: npt.NDArray[Any] | None = None,
                    new_values: npt.NDArray[Any] | None = None,
                    slot_mapping: npt.NDArray[np.int32] | None = None,
                    threads: int = 1, kv_cache_dtype: KVCacheDtype = "auto") -> None:
    """Paged attention on the CPU for one layer and step, into ``out``.

    ``query`` and ``out`` ``[tokens, heads, head_dim]``, the caches ``[slots, kv_heads,
    head_dim]`` (slot = block × ``block_size`` + offset), all C-contiguous: float32 arrays for
    ``dtype="float32"``, int16 arrays of the bits for ``"bfloat16"`` and ``"float16"``. Row
    ``r``'s new tokens are ``query_start_loc[r]:query_start_loc[r + 1]``, the last of its
    ``seq_lens[r]`` positions; its blocks are ``block_tables[r]``. Causal, within ``window``
    (sliding) or ``chunk`` positions when given; grouped-query heads; ``sinks`` (``[heads]``)
    adds gpt-oss's sink logit. With ``new_keys``/``new_values`` (``[tokens, kv_heads,
    head_dim]``) and ``slot_mapping``, writes them into their slots first (negative: none).
    A quantized cache (``kv_cache_dtype`` ``"int8"`` or ``"fp8_e4m3"``) is uint8 ``[slots,
    kv_heads, head_dim + 4]``, each row's codes then its scale, read in place; the new K/V
    (in ``dtype``) are quantized into their slots.
    Every input is checked before anything is read or written; ``threads`` threads, the GIL
    released."""

def linear(x: npt.NDArray[Any], weight: npt.NDArray[Any], out: npt.NDArray[Any], *,
           dtype: str, bias: npt.NDArray[Any] | None = None, threads: int = 1) -> None:
    """A linear layer's product over a few rows, into ``out``: ``out [rows, N] = x [rows, K]
    · weight [N, K]ᵀ``, plus ``bias [N]`` when given (added to the float32 sum, rounded once);
    all C-contiguous, float32 arrays for ``dtype="float32"``, int16 arrays of the bits for
    ``"bfloat16"`` and ``"float16"``. The weight is read once, in place; sums are float32, in an
    order that depends on the shapes only (any ``threads`` gives the same bits). Every size is
    checked before anything is written; ``threads`` threads (``paged_attention``'s), the GIL
    released."""

def use_openmp(library: str | os.PathLike[str]) -> None:
    """Runs ``paged_attention``'s threads on the team of an OpenMP runtime (libgomp, LLVM's
    libomp or Intel's libiomp5) instead of a pool of their own: the runtime ``library`` is,
    or the one it links (torch's ``libtorch_cpu.so``). ``library`` is an absolute path this
    process has already loaded. Once per process; ``ValueError`` for a relative path, a
    library not loaded, one with no ``GOMP_parallel``, or a second, different runtime."""

Int32Array = npt.NDArray[np.int32]
IntsLike = Sequence[int] | npt.NDArray[np.integer[Any]]
SeqIdsLike = IntsLike
TokenIdsLike = IntsLike

class AtbMemError(Exception):
    """Base class of every error atb-mem raises."""
class OutOfMemoryError(AtbMemError, MemoryError):
    """The pool or the KV-cache blocks are exhausted, or host memory ran out."""
class UnknownSequenceError(AtbMemError, KeyError):
    """No sequence has this id."""
class DuplicateSequenceError(AtbMemError, ValueError):
    """A sequence with this id exists already."""
class InvalidHandleError(AtbMemError, ValueError):
    """A double free, or a stale or foreign handle."""
class QueueFullError(AtbMemError, RuntimeError):
    """The request queue is full."""
class RequestTimeoutError(AtbMemError, TimeoutError):
    """A request waited longer than its timeout."""

class BlockMoveError(AtbMemError, RuntimeError):
    """Executing block moves failed; the pool was put back as it was before the operation.
    ``aborted_seq_ids``: the sequences whose bytes the partial execution destroyed (ended).
    The executor's exception is ``__cause__``."""
    aborted_seq_ids: list[int]

class RequestRefusedError(AtbMemError, ValueError):
    """The scheduler refuses a request that could never run: ``seq_id`` names it, ``reason``
    says why (the message is both)."""
    seq_id: int
    reason: str

MoveExecutor = Callable[[Int32Array], object]
"""Executes int32 ``[k, 3]`` (kind, src, dst) block moves in order; kind 0 = copy, 1 = to
host, 2 = to device. On failure it may set ``moves_attempted`` on its exception."""

class KVCachePool:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots (block 0 reserved).

    Thread-safe: every method takes the pool's lock; large batch calls release the GIL.
    A call that raises leaves the pool exactly as it was.
    """

    def __new__(cls, num_blocks: int, block_size: int, *, num_layers: int | None = None,
                num_kv_heads: int | None = None, head_dim: int | None = None,
                dtype: KVDtype | KVDtypeAlias | type[np.generic] | np.dtype[Any] | None = None,
                enable_prefix_caching: bool = True,
                num_host_blocks: int | None = None, host_prefix_cache: bool = False,
                enable_kv_events: bool = False,
                layer_types: Sequence[str] | None = None, sliding_window: int | None = None,
                attention_chunk_size: int | None = None,
                eviction_policy: Literal["lru", "lfu", "slru", "priority"] | None = None,
                hash_block_size: int | None = None, state_bytes: int | None = None,
                state_checkpoint_interval: int | None = None,
                kv_cache_dtype: KVCacheDtype | None = None) -> Self: ...
    @property
    def hash_block_size(self) -> int:
        """Tokens per prefix key: ``block_size`` unless hits finer than a block were asked for."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def _groups(self) -> list[tuple[str, list[int], int | None]]:
        """``(kind, layers, window)`` per KV-cache group (``KVCachePool.groups`` wraps it)."""
    @property
    def layers_per_block(self) -> int:
        """Layers whose K/V one block holds (``num_layers`` without groups)."""
    def group_of_layer(self, layer: int) -> tuple[int, int]:
        """``(group, slot)`` of a model layer: its group's tables address it, at ``slot``."""
    @property
    def _state_groups(self) -> list[tuple[list[int], int, int, int]]:
        """``(layers, state_bytes, num_blocks, first_column)`` per state group."""
    @property
    def num_state_blocks(self) -> int:
        """Blocks each sequence holds for its recurrent layers' states, whatever its length."""
    def state_of_layer(self, layer: int) -> tuple[int, int]:
        """``(state group, slot)`` of a recurrent layer."""
    def state_table(self, seq_ids: IntsLike) -> Int32Array:
        """int32 ``[len(seq_ids), num_state_blocks]``: each (device) sequence's state blocks."""
    @property
    def state_checkpoint_interval(self) -> int:
        """Blocks between two checkpoints of a sequence's recurrent states."""
    @property
    def checkpoint_stride(self) -> int:
        """Tokens between two checkpoints; 0 when this cache keeps none."""
    def checkpoint_state(self, seq_id: int) -> bool:
        """Keeps a checkpoint of the sequence's recurrent states at its computed tokens if
        they end at its prompt's last block boundary, where its shared prefix ended, or on
        the stride; whether copies were planned."""
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> KVDtype: ...
    @property
    def kv_cache_dtype(self) -> KVCacheDtype: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def bytes_per_block(self) -> int:
        """Bytes of K plus V across all layers for one block."""
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached blocks."""
    def alloc_sequence(
        self, seq_id: int, tokens: int | TokenIdsLike, *, cache_salt: str | bytes | None = None
    ) -> int:
        """Allocates blocks for a new sequence; returns how many leading tokens are cached.

        ``tokens`` is a count or the token ids (which enable prefix reuse). The last token is
        never served from the cache, and the sequence's own full blocks join it only once
        ``mark_computed`` says they are computed. All-or-nothing: raises OutOfMemoryError
        and changes nothing when free plus evictable blocks do not suffice.
        """
    def can_allocate(
        self, tokens: int | TokenIdsLike, *, cache_salt: str | bytes | None = None
    ) -> bool: ...
    def _explain_prefix(
        self, token_ids: TokenIdsLike, *, cache_salt: str | bytes | None = None
    ) -> tuple[int, str, int | None, list[tuple[int, str]], list[tuple[str, int]], int]:
        """(hit tokens, reason, limiting group, [(cached tokens, reason)] per group,
        [(tier, tokens)] in order, partial tokens)."""
    def _record_tier_event(self, medium: Literal["disk", "store"], stored: bool,
                           hashes: Sequence[Sequence[int]], parent: Sequence[int] | None,
                           token_ids: TokenIdsLike) -> None:
        """A tier below the host stored (or removed) the chain ``hashes`` (uint64 pairs)."""
    def _record_tier_hits(self, medium: Literal["disk", "store"], blocks: int,
                          filled: str | None = None) -> None:
        """``blocks`` whole blocks of an admission's prefix a tier below the host served (its
        load landed): hits, with their tier, in ``stats``. ``filled``: the admission's miss
        reason, where the load served every block the prompt can hit (then no miss)."""
    def block_hashes(
        self,
        token_ids: TokenIdsLike,
        *,
        cache_salt: str | bytes | None = None,
        parent: Sequence[int] | None = None,
    ) -> npt.NDArray[np.uint64]:
        """The chain hashes of the full blocks, ``[n, 2]``: a block's name in every tier.
        With ``parent``, a block's two hash words, the chain goes on from it over
        ``token_ids``, the tokens after that block (its salt is in its chain already: no
        ``cache_salt``)."""
    def seq_len(self, seq_id: int) -> int: ...
    def __contains__(self, seq_id: int) -> bool: ...
    def __len__(self) -> int: ...
    def seq_ids(self) -> list[int]:
        """Ids of the live sequences, sorted."""
    def append_tokens(
        self, seq_ids: SeqIdsLike, n: int | None = None, token_ids: TokenIdsLike | None = None
    ) -> Int32Array:
        """Appends ``n`` tokens to each sequence; returns their slots, sequence by sequence
        (``[groups, batch × n]``, group by group, with several KV-cache groups).

        ``token_ids`` (``[batch, n]`` or flat) lets blocks that fill up join the prefix cache.
        All-or-nothing for the whole batch.
        """
    def slot_mapping(self, seq_ids: SeqIdsLike, starts: IntsLike, ends: IntsLike, *,
                     group: int = 0) -> Int32Array:
        """Slots of tokens ``[starts[i], ends[i])`` of each sequence in ``group``,
        concatenated."""
    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; appends copy on write."""
    def free_sequence(self, seq_id: int) -> None: ...
    def mark_computed(self, seq_id: int, num_tokens: int | None = None) -> int:
        """Records that the K/V of the first ``num_tokens`` tokens (all with None) is
        written; full blocks with known ids within them join the prefix cache. Returns how
        many joined."""
    def num_computed(self, seq_id: int) -> int:
        """Leading tokens whose K/V is known to be computed."""
    def pending_moves(self) -> Int32Array:
        """Pending block moves, int32 ``[k, 3]`` of (kind, src, dst), without taking them."""
    def execute_pending_moves(self, execute: MoveExecutor) -> int:
        """Executes every pending move as one transaction (see ``BlockMoveError``)."""
    def take_pending_copies(self) -> Int32Array:
        """Takes the pending moves; returns the copy-on-write pairs among them, int32
        ``[k, 2]`` of (src, dst), for a caller that moves the bytes itself."""
    def write_slots(self, slots: IntsLike, execute: MoveExecutor,
                    write: Callable[[], object]) -> None:
        """Under the pool's lock: executes pending moves, checks ``slots``, calls ``write()``."""
    def block_tables(self, seq_ids: SeqIdsLike, *, group: int = 0) -> Int32Array:
        """int32 ``[batch, max_blocks]`` of ``group``, padded with block 0."""
    def block_table(self, seq_id: int, *, group: int = 0) -> Int32Array:
        """int32 blocks of one sequence in ``group``, in token order (0 where a window
        released one)."""
    def context_lens(self, seq_ids: SeqIdsLike) -> Int32Array: ...
    def page_table_csr(self, seq_ids: SeqIdsLike, *,
                       group: int = 0) -> tuple[Int32Array, Int32Array, Int32Array]:
        """FlashInfer's ``(kv_indptr, kv_indices, kv_last_page_len)``, all int32; a
        windowed group's lists the blocks its window still holds (read them with
        ``window_left = window - 1``), never the null block."""
    def batch_table(self, max_seqs: int, max_blocks_per_seq: int) -> BatchTable: ...
    @property
    def num_host_blocks(self) -> int:
        """Usable blocks of the host tier (0 without one)."""
    @property
    def host_prefix_cache(self) -> bool:
        """Whether cached blocks the device evicts are kept in the host tier."""
    @property
    def eviction_policy(self) -> Literal["lru", "lfu", "slru", "priority"]:
        """Which cached block goes first (SGLang's names)."""
    @property
    def num_free_host_blocks(self) -> int: ...
    def is_swapped(self, seq_id: int) -> bool: ...
    def swap_out(self, seq_ids: SeqIdsLike, execute: MoveExecutor | None = None) -> Int32Array:
        """Moves the sequences to the host tier; returns int32 ``[k, 2]`` (device, host)
        pairs, a shared block listed once. With ``execute``, one transaction that also runs
        every pending move; without, the moves stay pending. All-or-nothing."""
    def swap_in(self, seq_ids: SeqIdsLike, execute: MoveExecutor | None = None) -> Int32Array:
        """Brings swapped-out sequences back; returns int32 ``[k, 2]`` (host, device) pairs."""
    def check_slots(self, slots: IntsLike) -> None:
        """Raises ValueError unless every slot (negative = padding) is in a held block."""
    def unused_blocks(self) -> Int32Array:
        """Blocks no sequence holds and the prefix cache does not keep (nothing may read them)."""
    def reset_prefix_cache(self) -> int:
        """Drops every cached block no sequence uses; returns how many."""
    def set_retention(
        self, seq_id: int, ranges: Sequence[tuple[int, int | None, int, int | None]], *,
        decode: tuple[int, int | None] | None = None, default_priority: int | None = None
    ) -> None:
        """What ``seq_id`` asks the prefix cache to keep: (start, end, priority 0-100,
        duration_ns) ranges, the decode tokens' (priority, duration_ns), the rest's priority."""
    def advance_clock(self, now_ns: int) -> None:
        """Moves the retention clock on; priorities whose duration ended fall back to 35."""
    @property
    def enable_kv_events(self) -> bool: ...
    def take_events(self) -> KVEventList:
        """The KV-cache events recorded since the last call, oldest first (see
        ``atb_mem.events``), typed when first read; always empty unless the pool has
        ``enable_kv_events``."""
    def stats(self) -> KVCacheStats: ...
    def _check_invariants(self) -> None:
        """Raises AssertionError naming the first broken internal invariant."""

@final
class KVEventList(Sequence[KVCacheEvent]):
    """The events of one drain (``KVCachePool.take_events()``), typed when first read."""

    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int) -> KVCacheEvent: ...
    @overload
    def __getitem__(self, index: slice) -> list[KVCacheEvent]: ...
    def __iter__(self) -> Iterator[KVCacheEvent]: ...
    def __eq__(self, other: object) -> bool: ...
    @property
    def buffer(self) -> npt.NDArray[np.uint64]:
        """uint64 ``[E]``, the ``[E, 9]`` table, the hashes, the token ids as uint32 pairs
        (see ``atb_mem.events.events_from_buffer``)."""

@final
class BatchTable:
    """Persistent decode-step buffers of the running batch, updated in place.

    ``block_tables``, ``context_lens`` and ``slot_mapping`` are read-only numpy views over
    memory the core owns; their addresses never change. Rows ``[0, len(table))`` are live.
    ``append_tokens`` writes them in place (without the GIL for very large tables): read or
    copy them between steps, not while another thread appends.
    """

    def add(self, seq_id: int) -> None: ...
    def remove(self, seq_id: int) -> None:
        """Removes a row; the last row moves into the hole."""
    def clear(self) -> None: ...
    def append_tokens(self, token_ids: TokenIdsLike | None = None) -> None:
        """Appends one token to every row; writes only the entries that change (blocks a
        window released since, as ``mark_computed`` says, turn to block 0 here)."""
    def __len__(self) -> int: ...
    def __contains__(self, seq_id: int) -> bool: ...
    @property
    def seq_ids(self) -> list[int]: ...
    @property
    def max_seqs(self) -> int: ...
    @property
    def max_blocks_per_seq(self) -> int: ...
    @property
    def pool(self) -> KVCachePool: ...
    @property
    def block_tables(self) -> Int32Array:
        """int32 ``[max_seqs, max_blocks_per_seq]``; with several KV-cache groups
        ``[groups, max_seqs, max_blocks_per_seq]``."""
    @property
    def context_lens(self) -> Int32Array: ...
    @property
    def slot_mapping(self) -> Int32Array:
        """int32 ``[max_seqs]``, -1 for rows without a new token; with several KV-cache
        groups ``[groups, max_seqs]``."""

@final
class HostRegion:
    """One aligned, zeroed host allocation: the bytes of a host-backed ``MemPool``.

    The backing protocol: ``ptr`` (base address), ``nbytes`` and
    ``view(offset, nbytes, dtype, shape)``. Any object with these can back a pool.
    """

    def __new__(cls, nbytes: int, alignment: int | None = None) -> HostRegion: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def view(
        self, offset: int, nbytes: int, dtype: Any, shape: int | Sequence[int] | None = None
    ) -> npt.NDArray[Any]:
        """A numpy array over bytes ``[offset, offset + nbytes)`` that keeps the region alive."""

@final
class Allocation:
    """A live allocation from a ``MemPool``: bytes ``[offset, offset + size)`` at ``ptr``."""

    @property
    def offset(self) -> int: ...
    @property
    def size(self) -> int:
        """Usable bytes: the request rounded up by the pool's policy and alignment."""
    @property
    def ptr(self) -> int:
        """The pool's base address plus ``offset`` (the offset itself without a backing)."""
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class MemPool:
    """A preallocated byte pool with O(1) ``malloc``/``free`` of any size inside it.

    Thread-safe. A call that raises leaves the pool exactly as it was. After ``close()`` every
    call raises ``InvalidHandleError``.
    """

    def __new__(cls, capacity: int, *, alignment: int | None = None,
                policy: AlignmentPolicy | None = None,
                backing: Literal["host"] | MemoryBacking | None = "host",
                max_allocations: int | None = None) -> Self: ...
    @property
    def capacity(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    @property
    def policy(self) -> AlignmentPolicy: ...
    @property
    def backing(self) -> MemoryBacking | None:
        """The object that owns the bytes (a ``HostRegion`` by default; None offsets-only)."""
    @property
    def base_ptr(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def rounded_size(self, size: int) -> int:
        """Bytes ``malloc(size)`` takes from the pool."""
    def malloc(self, size: int) -> Allocation:
        """Raises OutOfMemoryError (naming the request, free bytes and largest free range)."""
    def free(self, allocation_or_ptr: Allocation | int) -> None:
        """A double free, stale or foreign handle raises InvalidHandleError."""
    def owns(self, allocation: Allocation) -> bool:
        """Whether ``allocation`` is live in this pool."""
    def view(
        self, allocation: Allocation, dtype: Any, shape: int | Sequence[int] | None = None
    ) -> Any:
        """The allocation's bytes as ``dtype`` (and ``shape``), without a copy."""
    def reset(self) -> None:
        """Frees every allocation; outstanding handles become stale."""
    def trim_to(self, min_bytes_to_keep: int) -> int:
        """Releases the free tail beyond ``min_bytes_to_keep``; returns the bytes released."""
    def close(self) -> None:
        """Frees everything and drops the pool's reference to its bytes."""
    def stats(self) -> MemPoolStats:
        """torch-style keys: ``allocated_bytes.current``, ``reserved_bytes.peak``, ..."""
    def snapshot(self) -> list[LiveAllocation]:
        """Live allocations in address order: offset, size, requested, ptr."""
    def free_ranges(self) -> list[tuple[int, int]]:
        """Free ranges in address order: (offset, size)."""
    def _check_invariants(self) -> None: ...
    def __len__(self) -> int: ...

def scatter_rows(dst: npt.NDArray[np.uint8], row_bytes: int, rows_per_source: int,
                 rows: npt.NDArray[np.int64],
                 sources: list[tuple[int, npt.NDArray[np.uint8]]]) -> None:
    """Host ReshapeAndCache: for each ``(offset, src)``, ``dst`` from ``offset`` on is rows of
    ``row_bytes`` and row ``rows[i]`` gets ``src``'s i-th row (negative rows are padding).
    Bounds-checked; used by the host backings' ``write_kv``."""

def copy_blocks(dst: npt.NDArray[np.uint8], dst_blocks: int, src: npt.NDArray[np.uint8] | None,
                src_blocks: int, chunk_bytes: int, pairs: npt.NDArray[np.int32]) -> None:
    """Host block copies between tiers laid out ``[groups, blocks, chunk_bytes]``: for every
    group, block ``pairs[i, 1]`` of ``dst`` gets block ``pairs[i, 0]`` of ``src`` (of ``dst``
    itself when ``src`` is None). Bounds-checked."""

@final
class RequestBatcher:
    """Deterministic request-batching policy behind ``DynamicBatchScheduler`` (times in ns).

    A configuration is a ``RequestBatcherConfig``: every key, nothing else.
    """

    def __new__(cls, config: RequestBatcherConfig) -> RequestBatcher: ...
    @staticmethod
    def check_config(config: RequestBatcherConfig) -> None:
        """Raises if ``config`` is not a valid configuration; builds nothing."""
    def config(self) -> RequestBatcherConfig: ...
    def set_config(self, config: RequestBatcherConfig) -> RequestBatcherConfig:
        """Validated first; returns the previous configuration."""
    def submit(
        self, request_id: int, priority: int, now_ns: int, timeout_ns: int | None = None
    ) -> None:
        """QueueFullError when full; DuplicateSequenceError for an id already queued."""
    def cancel(self, request_id: int) -> bool: ...
    def poll(self, now_ns: int) -> tuple[list[int], list[int], int | None]:
        """(batch ids, expired ids, next wake-up in ns or None)."""
    def drain(self) -> list[int]: ...
    def __len__(self) -> int: ...
    def __contains__(self, request_id: int) -> bool: ...

@final
class StepPlan:
    """One step's decisions and a model runner's inputs (see ``ContinuousBatchScheduler``).

    Frozen; arrays are int32 but the ids (uint64). ``block_tables`` is a read-only view of a
    buffer the scheduler updates in place, valid until the next step.
    """

    @property
    def prefill_seq_ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def prefill_tokens(self) -> Int32Array: ...
    @property
    def decode_seq_ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def sample_seq_ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def preempted_seq_ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def finished_seq_ids(self) -> npt.NDArray[np.uint64]:
        """Requests that ended (finished or aborted) since the previous plan."""
    @property
    def moves(self) -> Int32Array:
        """``[k, 3]`` (kind, src, dst) in execution order: 0 copy, 1 to host, 2 to device."""
    @property
    def copies(self) -> Int32Array: ...
    @property
    def swap_out(self) -> Int32Array: ...
    @property
    def swap_in(self) -> Int32Array: ...
    @property
    def query_lens(self) -> Int32Array: ...
    @property
    def context_lens(self) -> Int32Array: ...
    @property
    def seq_lens(self) -> Int32Array: ...
    @property
    def query_start_loc(self) -> Int32Array: ...
    @property
    def block_tables(self) -> Int32Array: ...
    @property
    def input_ids(self) -> Int32Array: ...
    @property
    def positions(self) -> Int32Array: ...
    @property
    def slot_mapping(self) -> Int32Array: ...
    @property
    def logits_indices(self) -> Int32Array: ...
    @property
    def num_batched_tokens(self) -> int: ...
    @property
    def load_seq_ids(self) -> npt.NDArray[np.uint64]:
        """Per block to load from a lower tier: its request (see ``finish_loads``)."""
    @property
    def load_blocks(self) -> Int32Array:
        """Per block to load: the device block the bytes go to."""
    @property
    def load_keys(self) -> npt.NDArray[np.uint64]:
        """Per block to load: the chain hash of its contents, ``[k, 2]``."""
    @property
    def seq_ids(self) -> npt.NDArray[np.uint64]:
        """Sequence ids by row."""
    def __len__(self) -> int: ...

@final
class ContinuousScheduler:
    """Continuous-batching policy behind ``ContinuousBatchScheduler`` (times in ns).

    A configuration is a ``ContinuousSchedulerConfig``: every key, nothing else.
    """

    def __new__(cls, kv_cache: KVCachePool,
                config: ContinuousSchedulerConfig) -> ContinuousScheduler: ...
    def config(self) -> ContinuousSchedulerConfig: ...
    def check_config(self, config: ContinuousSchedulerConfig) -> None:
        """Raises unless ``config`` could replace the current one (valid, and no request in
        the scheduler stranded by it); changes nothing."""
    def check_request(self, config: ContinuousSchedulerConfig, seq_id: int,
                      prompt: int | TokenIdsLike, max_new_tokens: int,
                      num_samples: int) -> None:
        """Raises unless such a request could ever be scheduled under ``config``."""
    def set_config(self, config: ContinuousSchedulerConfig) -> ContinuousSchedulerConfig:
        """Validated first; returns the previous configuration."""
    def add_request(self, seq_id: int, prompt: int | TokenIdsLike, max_new_tokens: int,
                    priority: int, arrival_ns: int, num_samples: int = 1) -> None: ...
    def set_retention(
        self, seq_id: int, ranges: Sequence[tuple[int, int | None, int, int | None]], *,
        decode: tuple[int, int | None] | None = None, default_priority: int | None = None
    ) -> None:
        """A request's retention (as ``KVCachePool.set_retention``), given at every admission."""
    def step(self, now_ns: int, execute: MoveExecutor | None = None) -> StepPlan:
        """The step plan as numpy arrays (see ``atb_mem.StepPlan``)."""
    def on_tokens(
        self, seq_ids: SeqIdsLike, token_ids: TokenIdsLike, eos_token_id: int | None = None
    ) -> npt.NDArray[np.uint64]:
        """Returns the ids of the sequences that finished."""
    def offer_external_prefix(self, seq_id: int, num_blocks: int) -> None:
        """Lower tiers hold the request's first ``num_blocks`` full blocks: its admission
        loads what the device and the host do not hold, and it waits for ``finish_loads``."""
    def finish_loads(self, seq_ids: SeqIdsLike, done: Sequence[bool]) -> None:
        """Reports loads: done ones count as computed, failed ones are recomputed."""
    def abort(self, seq_id: int) -> None: ...
    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Parallel sampling: the child shares a sampled parent's blocks, copy-on-write."""
    def progress(self, seq_id: int) -> tuple[int, int, int]: ...
    def counts(self) -> SchedulerCounts: ...
    def __contains__(self, seq_id: int) -> bool: ...
    def _check_invariants(self) -> None: ...
