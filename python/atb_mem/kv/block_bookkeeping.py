"""`BlockBookkeeping`: which blocks hold what, the Rust core's, forwarded by `KVCachePool`.

Each method and property here calls the same-named one of the pool's core (see
``atb_mem._forwarding``); the docstrings are the core's, from ``_core.pyi`` (a test keeps them
equal). What the Python class changes (``swap_out``, ``swap_in``, ``stats``) or builds on the
core's private answers (``groups``, ``state_groups``, ``explain_prefix``) is in
``cache_pool.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from atb_mem import _core
from atb_mem._forwarding import forwards_to

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from atb_mem._core import (
        BatchTable,
        Int32Array,
        IntsLike,
        KVEventList,
        MoveExecutor,
        SeqIdsLike,
        TokenIdsLike,
    )
    from atb_mem._types import KVCacheDtype, KVDtype

__all__ = ["BlockBookkeeping"]


@forwards_to(_core.KVCachePool)
class BlockBookkeeping:
    """The core's blocks, sequences and prefix cache, answered by ``core`` (a
    ``_core.KVCachePool``)."""

    _core: _core.KVCachePool

    BOUND_FORWARDS = ("alloc_sequence", "can_allocate", "seq_len", "append_tokens", "fork",
                      "free_sequence", "mark_computed", "num_computed", "block_table",
                      "block_tables", "context_lens", "slot_mapping")
    """The per-request and per-step calls, bound on each instance to the core's methods
    (``atb_mem._forwarding.bind_forwards``): no Python frame between a caller and Rust."""

    # ---- what the pool was built with ------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block 0 included."""
        return self._core.num_blocks

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self._core.block_size

    @property
    def hash_block_size(self) -> int:
        """Tokens per prefix key: ``block_size`` unless hits finer than a block were asked for."""
        return self._core.hash_block_size

    @property
    def num_layers(self) -> int:
        """Layers of the model whose K/V the pool holds."""
        return self._core.num_layers

    @property
    def layers_per_block(self) -> int:
        """Layers whose K/V one block holds (``num_layers`` without groups)."""
        return self._core.layers_per_block

    def group_of_layer(self, layer: int) -> tuple[int, int]:
        """``(group, slot)`` of a model layer: its group's tables address it, at ``slot``."""
        return self._core.group_of_layer(layer)

    @property
    def num_kv_heads(self) -> int:
        """K/V heads per layer."""
        return self._core.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Elements per head."""
        return self._core.head_dim

    @property
    def dtype(self) -> KVDtype:
        """The K/V element type, by canonical name."""
        return self._core.dtype

    @property
    def kv_cache_dtype(self) -> KVCacheDtype:
        """How the cache stores K/V: ``"auto"`` (as ``dtype``), or quantized per token and KV
        head, ``"int8"`` or ``"fp8_e4m3"`` (rows of one-byte codes and their scale)."""
        return self._core.kv_cache_dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K plus V across all layers for one block."""
        return self._core.bytes_per_block

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether computed full blocks are kept for later prompts that share them."""
        return self._core.enable_prefix_caching

    @property
    def eviction_policy(self) -> Literal["lru", "lfu", "slru", "priority"]:
        """Which cached block goes first (SGLang's names)."""
        return self._core.eviction_policy

    @property
    def enable_kv_events(self) -> bool:
        """Whether the pool records KV-cache events (``take_events``)."""
        return self._core.enable_kv_events

    # ---- recurrent layers' states ----------------------------------------------------------

    @property
    def num_state_blocks(self) -> int:
        """Blocks each sequence holds for its recurrent layers' states, whatever its length."""
        return self._core.num_state_blocks

    def state_of_layer(self, layer: int) -> tuple[int, int]:
        """``(state group, slot)`` of a recurrent layer."""
        return self._core.state_of_layer(layer)

    def state_table(self, seq_ids: IntsLike) -> Int32Array:
        """int32 ``[len(seq_ids), num_state_blocks]``: each (device) sequence's state blocks."""
        return self._core.state_table(seq_ids)

    @property
    def state_checkpoint_interval(self) -> int:
        """Blocks between two checkpoints of a sequence's recurrent states."""
        return self._core.state_checkpoint_interval

    @property
    def checkpoint_stride(self) -> int:
        """Tokens between two checkpoints; 0 when this cache keeps none."""
        return self._core.checkpoint_stride

    def checkpoint_state(self, seq_id: int) -> bool:
        """Keeps a checkpoint of the sequence's recurrent states at its computed tokens if
        they end at its prompt's last block boundary, where its shared prefix ended, or on
        the stride; whether copies were planned."""
        return self._core.checkpoint_state(seq_id)

    # ---- sequences -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached blocks."""
        return self._core.num_free_blocks

    def alloc_sequence(
        self, seq_id: int, tokens: int | TokenIdsLike, *, cache_salt: str | bytes | None = None
    ) -> int:
        """Allocates blocks for a new sequence; returns how many leading tokens are cached.

        ``tokens`` is a count or the token ids (which enable prefix reuse). The last token is
        never served from the cache, and the sequence's own full blocks join it only once
        ``mark_computed`` says they are computed. All-or-nothing: raises OutOfMemoryError
        and changes nothing when free plus evictable blocks do not suffice.
        """
        return self._core.alloc_sequence(seq_id, tokens, cache_salt=cache_salt)

    def can_allocate(
        self, tokens: int | TokenIdsLike, *, cache_salt: str | bytes | None = None
    ) -> bool:
        """Whether ``alloc_sequence`` of these tokens would succeed now."""
        return self._core.can_allocate(tokens, cache_salt=cache_salt)

    def seq_len(self, seq_id: int) -> int:
        """Tokens the sequence holds."""
        return self._core.seq_len(seq_id)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._core

    def __len__(self) -> int:
        return len(self._core)

    def seq_ids(self) -> list[int]:
        """Ids of the live sequences, sorted."""
        return self._core.seq_ids()

    def append_tokens(
        self, seq_ids: SeqIdsLike, n: int | None = None, token_ids: TokenIdsLike | None = None
    ) -> Int32Array:
        """Appends ``n`` tokens to each sequence; returns their slots, sequence by sequence
        (``[groups, batch × n]``, group by group, with several KV-cache groups).

        ``token_ids`` (``[batch, n]`` or flat) lets blocks that fill up join the prefix cache.
        All-or-nothing for the whole batch.
        """
        return self._core.append_tokens(seq_ids, n, token_ids)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; appends copy on write."""
        self._core.fork(parent_id, child_id)

    def free_sequence(self, seq_id: int) -> None:
        """Frees the sequence's blocks (those the prefix cache keeps stay cached)."""
        self._core.free_sequence(seq_id)

    def mark_computed(self, seq_id: int, num_tokens: int | None = None) -> int:
        """Records that the K/V of the first ``num_tokens`` tokens (all with None) is
        written; full blocks with known ids within them join the prefix cache. Returns how
        many joined."""
        return self._core.mark_computed(seq_id, num_tokens)

    def num_computed(self, seq_id: int) -> int:
        """Leading tokens whose K/V is known to be computed."""
        return self._core.num_computed(seq_id)

    # ---- tables the kernels read -----------------------------------------------------------

    def slot_mapping(self, seq_ids: SeqIdsLike, starts: IntsLike, ends: IntsLike, *,
                     group: int = 0) -> Int32Array:
        """Slots of tokens ``[starts[i], ends[i])`` of each sequence in ``group``,
        concatenated."""
        return self._core.slot_mapping(seq_ids, starts, ends, group=group)

    def block_tables(self, seq_ids: SeqIdsLike, *, group: int = 0) -> Int32Array:
        """int32 ``[batch, max_blocks]`` of ``group``, padded with block 0."""
        return self._core.block_tables(seq_ids, group=group)

    def block_table(self, seq_id: int, *, group: int = 0) -> Int32Array:
        """int32 blocks of one sequence in ``group``, in token order (0 where a window
        released one)."""
        return self._core.block_table(seq_id, group=group)

    def context_lens(self, seq_ids: SeqIdsLike) -> Int32Array:
        """int32 tokens each sequence holds."""
        return self._core.context_lens(seq_ids)

    def page_table_csr(self, seq_ids: SeqIdsLike, *,
                       group: int = 0) -> tuple[Int32Array, Int32Array, Int32Array]:
        """FlashInfer's ``(kv_indptr, kv_indices, kv_last_page_len)``, all int32; a
        windowed group's lists the blocks its window still holds (read them with
        ``window_left = window - 1``), never the null block."""
        return self._core.page_table_csr(seq_ids, group=group)

    def batch_table(self, max_seqs: int, max_blocks_per_seq: int) -> BatchTable:
        """Persistent decode-step buffers for up to ``max_seqs`` sequences."""
        return self._core.batch_table(max_seqs, max_blocks_per_seq)

    def check_slots(self, slots: IntsLike) -> None:
        """Raises ValueError unless every slot (negative = padding) is in a held block."""
        self._core.check_slots(slots)

    def unused_blocks(self) -> Int32Array:
        """Blocks no sequence holds and the prefix cache does not keep (nothing may read them)."""
        return self._core.unused_blocks()

    # ---- block moves -----------------------------------------------------------------------

    def pending_moves(self) -> Int32Array:
        """Pending block moves, int32 ``[k, 3]`` of (kind, src, dst), without taking them."""
        return self._core.pending_moves()

    def execute_pending_moves(self, execute: MoveExecutor) -> int:
        """Executes every pending move as one transaction (see ``BlockMoveError``)."""
        return self._core.execute_pending_moves(execute)

    def take_pending_copies(self) -> Int32Array:
        """Takes the pending moves; returns the copy-on-write pairs among them, int32
        ``[k, 2]`` of (src, dst), for a caller that moves the bytes itself."""
        return self._core.take_pending_copies()

    def write_slots(self, slots: IntsLike, execute: MoveExecutor,
                    write: Callable[[], object]) -> None:
        """Under the pool's lock: executes pending moves, checks ``slots``, calls ``write()``."""
        self._core.write_slots(slots, execute, write)

    # ---- the host tier ---------------------------------------------------------------------

    @property
    def num_host_blocks(self) -> int:
        """Usable blocks of the host tier (0 without one)."""
        return self._core.num_host_blocks

    @property
    def host_prefix_cache(self) -> bool:
        """Whether cached blocks the device evicts are kept in the host tier."""
        return self._core.host_prefix_cache

    @property
    def num_free_host_blocks(self) -> int:
        """Host-tier blocks a swap can take now."""
        return self._core.num_free_host_blocks

    def is_swapped(self, seq_id: int) -> bool:
        """Whether the sequence is in the host tier (swapped out)."""
        return self._core.is_swapped(seq_id)

    # ---- the prefix cache ------------------------------------------------------------------

    def block_hashes(
        self, token_ids: TokenIdsLike, *, cache_salt: str | bytes | None = None,
        parent: Sequence[int] | None = None
    ) -> npt.NDArray[np.uint64]:
        """The chain hashes of the full blocks, ``[n, 2]``: a block's name in every tier.
        With ``parent``, a block's two hash words, the chain goes on from it over
        ``token_ids``, the tokens after that block (its salt is in its chain already: no
        ``cache_salt``)."""
        return self._core.block_hashes(token_ids, cache_salt=cache_salt, parent=parent)

    def reset_prefix_cache(self) -> int:
        """Drops every cached block no sequence uses; returns how many."""
        return self._core.reset_prefix_cache()

    def set_retention(
        self, seq_id: int, ranges: Sequence[tuple[int, int | None, int, int | None]], *,
        decode: tuple[int, int | None] | None = None, default_priority: int | None = None
    ) -> None:
        """What ``seq_id`` asks the prefix cache to keep: (start, end, priority 0-100,
        duration_ns) ranges, the decode tokens' (priority, duration_ns), the rest's priority."""
        self._core.set_retention(seq_id, ranges, decode=decode,
                                 default_priority=default_priority)

    def advance_clock(self, now_ns: int) -> None:
        """Moves the retention clock on; priorities whose duration ended fall back to 35."""
        self._core.advance_clock(now_ns)

    def take_events(self) -> KVEventList:
        """The KV-cache events recorded since the last call, oldest first (see
        ``atb_mem.events``), typed when first read; always empty unless the pool has
        ``enable_kv_events``."""
        return self._core.take_events()

    def _record_tier_event(self, medium: Literal["disk", "store"], stored: bool,
                           hashes: Sequence[Sequence[int]], parent: Sequence[int] | None,
                           token_ids: TokenIdsLike) -> None:
        """A tier below the host stored (or removed) the chain ``hashes`` (uint64 pairs)."""
        self._core._record_tier_event(medium, stored, hashes, parent, token_ids)

    def _record_tier_hits(self, medium: Literal["disk", "store"], blocks: int,
                          filled: str | None = None) -> None:
        """``blocks`` whole blocks of an admission's prefix a tier below the host served (its
        load landed): hits, with their tier, in ``stats``. ``filled``: the admission's miss
        reason, where the load served every block the prompt can hit (then no miss)."""
        self._core._record_tier_hits(medium, blocks, filled)

    # ---- checks ----------------------------------------------------------------------------

    def _check_invariants(self) -> None:
        """Raises AssertionError naming the first broken internal invariant."""
        self._core._check_invariants()

    def __repr__(self) -> str:
        return repr(self._core)
