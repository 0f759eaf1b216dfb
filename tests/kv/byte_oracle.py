"""The byte oracle of the KV-bytes thread test: every token position holds a value no other
position holds. Key channel 0 is the id of the sequence that wrote it (a forked child keeps its
parent's id for the inherited tokens), channel 1 the position, channel 2 the layer, channel 3
the head; the value is ``-key - 1``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import atb_mem

NUM_BLOCKS = 1024  # 1023 usable: tight enough that allocations, appends and swap-ins fail
NUM_HOST_BLOCKS = 384  # tight enough that swap-outs fail now and then
BLOCK_SIZE = 16
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 4  # the four channels of the oracle's encoding


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def new_pool(num_blocks: int = NUM_BLOCKS, num_host_blocks: int = NUM_HOST_BLOCKS,
             ) -> atb_mem.KVCachePool:
    return atb_mem.KVCachePool(num_blocks, BLOCK_SIZE, num_layers=NUM_LAYERS,
                               num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype="float32",
                               num_host_blocks=num_host_blocks)


# ---- the oracle -------------------------------------------------------------------------------


def encode(origins: np.ndarray, positions: np.ndarray, layer: int,
           ) -> tuple[np.ndarray, np.ndarray]:
    """Key and value rows ``[n, heads, head_dim]`` of tokens at ``positions`` written by the
    sequences ``origins``, in ``layer``."""
    key = np.empty((len(origins), NUM_KV_HEADS, HEAD_DIM), np.float32)
    key[:, :, 0] = np.asarray(origins)[:, None]
    key[:, :, 1] = np.asarray(positions)[:, None]
    key[:, :, 2] = layer
    key[:, :, 3] = np.arange(1, NUM_KV_HEADS + 1)[None, :]
    return key, -key - 1


def check_bytes(kv: atb_mem.KVCachePool, seq_id: int, origins: np.ndarray, swapped: bool,
                seq_len: int | None = None) -> None:
    """Asserts that ``seq_id``'s tokens hold what the oracle says, read from the device cache
    or, while the sequence is swapped out, from the host tier at its host blocks.

    ``seq_len``: the sequence's length when it exceeds ``len(origins)`` (appended tokens not
    written yet: only the first ``len(origins)`` are checked)."""
    n = len(origins)
    seq_len = n if seq_len is None else seq_len
    assert kv.is_swapped(seq_id) == swapped, (seq_id, swapped)
    assert kv.seq_len(seq_id) == seq_len, (seq_id, kv.seq_len(seq_id), seq_len)
    blocks = kv.block_table(seq_id)
    assert len(blocks) == cdiv(seq_len, BLOCK_SIZE), (seq_id, blocks.tolist(), seq_len)
    if n == 0:
        return
    positions = np.arange(n)
    for layer in range(NUM_LAYERS):
        want_key, want_value = encode(origins, positions, layer)
        for half, want in ((0, want_key), (1, want_value)):
            if swapped:
                got = kv.host_kv_cache[layer, half, blocks]
            else:
                cache = kv.key_cache(layer) if half == 0 else kv.value_cache(layer)
                got = cache[blocks]
            got = got.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n]
            if not np.array_equal(got, want):
                bad = np.flatnonzero((got != want).any(axis=(1, 2)))
                pos = int(bad[0])
                where = "host" if swapped else "device"
                raise AssertionError(
                    f"sequence {seq_id} ({where}, blocks {blocks.tolist()[:8]}...): "
                    f"{len(bad)} wrong token(s) in layer {layer} {('key', 'value')[half]}; "
                    f"first at position {pos} (block {int(blocks[pos // BLOCK_SIZE])}): "
                    f"got {got[pos, 0].tolist()}, want {want[pos, 0].tolist()}"
                )


def write_tokens(kv: atb_mem.KVCachePool, slots: np.ndarray, origins: np.ndarray,
                 positions: np.ndarray) -> None:
    """Writes the oracle's rows for these tokens into their slots, every layer."""
    for layer in range(NUM_LAYERS):
        key, value = encode(origins, positions, layer)
        kv.write_kv(layer, slots, key, value)


@dataclass
class Seq:
    origins: np.ndarray  # per position: the id of the sequence whose write it holds
    swapped: bool = False
