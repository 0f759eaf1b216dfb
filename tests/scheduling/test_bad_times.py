"""Times that are no time (NaN, infinities, negatives, beyond the core's 64 bits of
nanoseconds) are bad arguments: a ValueError naming the argument, and nothing changes."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import atb_mem
from atb_mem import ContinuousBatchScheduler, DynamicBatchScheduler

NOT_A_TIME = [math.inf, -math.inf, math.nan, 1e300,
              pytest.param(10**400, id="10**400")]  # an int too large for a float


def continuous() -> ContinuousBatchScheduler:
    scheduler = ContinuousBatchScheduler(atb_mem.KVCachePool(64, 4, device=None), max_num_seqs=4)
    scheduler.add_request(1, 4, 2)
    return scheduler


@pytest.mark.parametrize("arrival_time", NOT_A_TIME)
def test_add_request_refuses_an_arrival_that_is_no_time(arrival_time: float) -> None:
    scheduler = continuous()
    before = scheduler.stats()
    with pytest.raises(ValueError, match="arrival_time"):
        scheduler.add_request(2, 4, 2, arrival_time=arrival_time)
    assert 2 not in scheduler and scheduler.stats() == before


@pytest.mark.parametrize("now", [*NOT_A_TIME, -1.0])
def test_step_refuses_a_now_that_is_no_time_and_applies_nothing(now: float) -> None:
    scheduler = continuous()
    scheduler.reconfigure(max_num_seqs=2)
    before = scheduler.stats()
    with pytest.raises(ValueError, match="now"):
        scheduler.step(now=now)
    assert scheduler.stats() == before and scheduler.config["max_num_seqs"] == 4
    assert scheduler.step(now=0.0).prefill_seq_ids.tolist() == [1]
    assert scheduler.config["max_num_seqs"] == 2  # the pending change waited for this step


def test_numpy_times_still_count() -> None:
    scheduler = continuous()
    scheduler.add_request(2, 4, 2, arrival_time=np.float32(1.0))
    assert scheduler.step(now=np.int64(0)).prefill_seq_ids.tolist() == [1]
    assert scheduler.step(now=np.float64(1.0)).prefill_seq_ids.tolist() == [2]


@pytest.mark.parametrize("value", NOT_A_TIME)
@pytest.mark.parametrize("setting", ["timeout_ms", "default_timeout_ms"])
def test_batcher_refuses_a_timeout_that_is_no_time(setting: str, value: float) -> None:
    with pytest.raises(ValueError, match=setting):
        DynamicBatchScheduler(**{setting: value})
    batcher = DynamicBatchScheduler(max_batch_size=4, timeout_ms=10)
    previous = batcher.config
    with pytest.raises(ValueError, match=setting):
        batcher.reconfigure(**{setting: value})
    batcher.submit("kept")
    batcher.reconfigure(max_batch_size=1)  # a later good change builds on the old settings
    batch = batcher.next_batch(timeout=0)
    assert batch.items == ["kept"]
    assert batcher.config == previous | {"max_batch_size": 1}


@pytest.mark.parametrize("timeout_ms", NOT_A_TIME)
def test_submit_refuses_a_timeout_that_is_no_time(timeout_ms: float) -> None:
    batcher = DynamicBatchScheduler(max_batch_size=4, timeout_ms=10)
    batcher.submit("kept")
    with pytest.raises(ValueError, match="timeout_ms"):
        batcher.submit("bad", timeout_ms=timeout_ms)
    assert len(batcher) == 1 and batcher.stats()["queue_length"] == 1
    batcher.submit("no timeout", timeout_ms=None)  # None still means the default
    assert len(batcher) == 2


def test_next_batch_refuses_nan_and_waits_forever_for_infinity() -> None:
    batcher = DynamicBatchScheduler(max_batch_size=1, timeout_ms=10)
    batcher.submit("due")  # a batch is due: the refusal must come before it is taken
    with pytest.raises(ValueError, match="timeout"):
        batcher.next_batch(timeout=math.nan)
    assert len(batcher) == 1 and batcher.stats()["batches"] == 0
    batcher.next_batch(timeout=0).set_results([None])
    for timeout in (math.inf, 1e300, 10**400):  # longer than any wait: the same as None
        later = threading.Timer(0.05, batcher.submit, args=(timeout,))
        later.start()
        batch = batcher.next_batch(timeout=timeout)
        later.join()
        assert batch.items == [timeout]
        batch.set_results([None])
