"""The reference paged attention, checked against dense attention (and torch's SDPA) on random
data, through the cache's block tables."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kv.kv_arrays import as_numpy, check_attention, make_pool, random_kv
from tests.support.devices import DEVICES


@pytest.mark.parametrize(("device", "dtype"), [
    ("host", "float32"), ("host", "float16"), ("cpu", "float32"), ("cpu", "float16"),
    ("cpu", "bfloat16"),
    pytest.param("cuda", "float16", marks=pytest.mark.cuda),
    pytest.param("cuda", "bfloat16", marks=pytest.mark.cuda),
])
def test_paged_attention_matches_dense(device: str, dtype: str) -> None:
    rng = np.random.default_rng(3)
    pool = make_pool(device, dtype=dtype, num_kv_heads=2, head_dim=16)
    lengths = [1, 4, 5, 13, 30]
    history: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for seq_id, length in enumerate(lengths):
        pool.alloc_sequence(seq_id, length)
        slots = pool.slot_mapping([seq_id], [0], [length])
        key, value = random_kv(pool, length, rng)
        pool.write_kv(1, slots, key, value)
        history[seq_id] = (as_numpy(key), as_numpy(value))
    check_attention(pool, history, lengths, rng, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_after_fork_and_copy_on_write(device: str) -> None:
    rng = np.random.default_rng(4)
    pool = make_pool(device, head_dim=16)
    pool.alloc_sequence(1, 6)  # the second block is partly filled
    key, value = random_kv(pool, 6, rng)
    pool.write_kv(1, pool.slot_mapping([1], [0], [6]), key, value)
    prefix = (as_numpy(key), as_numpy(value))
    pool.fork(1, 2)
    history = {}
    for seq_id in (1, 2):  # each branch samples its own next token
        slots = pool.append_tokens([seq_id])
        assert pool.apply_pending_copies() == (1 if seq_id == 1 else 0)
        new_key, new_value = random_kv(pool, 1, rng)
        pool.write_kv(1, slots, new_key, new_value)
        history[seq_id] = (np.concatenate([prefix[0], as_numpy(new_key)]),
                           np.concatenate([prefix[1], as_numpy(new_value)]))
    assert pool.block_table(1)[1] != pool.block_table(2)[1]
    check_attention(pool, history, [7, 7], rng, "float32")

