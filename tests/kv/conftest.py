from __future__ import annotations

import pytest

import atb_mem


@pytest.fixture
def pool() -> atb_mem.KVCachePool:
    """A small cache: 16 usable blocks of 4 tokens, bytes on the host."""
    return atb_mem.KVCachePool(num_blocks=17, block_size=4)
