from __future__ import annotations

import os
from typing import Any

import pytest

import atb_mem


def snapshot(pool: atb_mem.KVCachePool) -> dict[str, Any]:
    """Everything observable about a pool, for 'a failed call changed nothing' checks."""
    seq_ids = pool.seq_ids()
    return {
        "stats": pool.stats(),
        "num_free_blocks": pool.num_free_blocks,
        "seqs": {
            seq_id: (pool.seq_len(seq_id), pool.block_table(seq_id).tolist()) for seq_id in seq_ids
        },
    }


@pytest.fixture
def pool() -> atb_mem.KVCachePool:
    return atb_mem.KVCachePool(num_blocks=17, block_size=4)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI a skipped test is a failed run: nothing may pass by not running."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") and skipped and session.exitstatus == 0:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
