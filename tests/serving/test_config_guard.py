"""The guard's decisions under a synthetic load and an injected clock (no sleeping): a server
that makes ``rate(config)`` tokens per second for each request in it."""

from __future__ import annotations

from typing import Any

import pytest

from atb_mem.serving.config_guard import ConfigGuard, HealthRanges, StepSample

STEP = 0.1  # seconds per step


def run(guard: ConfigGuard, start: float, seconds: float, *, per_request_rate: float,
        in_system: int, kv_usage: float = 0.5, model_share: float = 0.9,
        ttft: float = 0.2) -> Any:
    """Steps for ``seconds``; returns the first decision (or None) and the clock."""
    now, decision = start, None
    while now < start + seconds - 1e-9:
        now += STEP
        sample = StepSample(now=now, output_tokens=round(per_request_rate * in_system * STEP),
                            unfinished=in_system, kv_usage=kv_usage, preemptions=0,
                            model_seconds=model_share * STEP, step_seconds=STEP,
                            busy_seconds=STEP,
                            first_token_latencies=(ttft,))
        decision = decision or guard.on_step(sample)
    return decision, now


def test_a_change_that_costs_more_than_ten_percent_is_rolled_back() -> None:
    guard = ConfigGuard({"max_num_seqs": 64}, window_s=30)
    _, now = run(guard, 0, 30, per_request_rate=100, in_system=20)
    guard.begin(now, {"max_num_seqs": 14}, {"max_num_seqs": 64}, watch_s=20)
    decision, _ = run(guard, now, 25, per_request_rate=88, in_system=20)
    assert decision.outcome == "rollback" and decision.reason == "throughput"
    assert decision.config == {"max_num_seqs": 64} and guard.stable == {"max_num_seqs": 64}
    assert decision.after.throughput == pytest.approx(0.88 * decision.before.throughput)
    assert guard.history[-1]["outcome"] == "rollback"


def test_a_change_within_the_threshold_or_better_is_kept() -> None:
    for rate in (95, 120):
        guard = ConfigGuard({"max_num_seqs": 64}, window_s=30)
        _, now = run(guard, 0, 30, per_request_rate=100, in_system=20)
        guard.begin(now, {"max_num_seqs": 96}, {"max_num_seqs": 64}, watch_s=20)
        decision, _ = run(guard, now, 25, per_request_rate=rate, in_system=20)
        assert decision.outcome == "stable", rate
        assert guard.stable == {"max_num_seqs": 96}


def test_idle_time_in_the_window_before_does_not_hide_a_regression() -> None:
    """Load starts 5 s before the change in a 30 s window: the server's speed is what it did
    while busy, so halving it is seen (over the whole window it would look like a gain)."""
    guard = ConfigGuard({"max_num_seqs": 64}, window_s=30)
    _, now = run(guard, 25, 5, per_request_rate=100, in_system=20)
    guard.begin(now, {"max_num_seqs": 1}, {"max_num_seqs": 64}, watch_s=20)
    decision, _ = run(guard, now, 25, per_request_rate=50, in_system=20)
    assert (decision.outcome, decision.reason) == ("rollback", "throughput")
    assert decision.before.throughput == pytest.approx(100)
    assert decision.before.busy_seconds == pytest.approx(5)


def test_less_offered_load_is_not_a_regression() -> None:
    """Half the requests, each served as fast: total tokens/s halves, the change stays."""
    guard = ConfigGuard({"watermark": 0.01}, window_s=30)
    _, now = run(guard, 0, 30, per_request_rate=100, in_system=20)
    guard.begin(now, {"watermark": 0.02}, {"watermark": 0.01}, watch_s=20)
    decision, _ = run(guard, now, 25, per_request_rate=100, in_system=10)
    assert decision.outcome == "stable"


def test_kv_usage_above_its_range_for_the_whole_watch_is_rolled_back() -> None:
    guard = ConfigGuard({"max_num_seqs": 64}, window_s=30)
    _, now = run(guard, 0, 30, per_request_rate=100, in_system=20)
    guard.begin(now, {"max_num_seqs": 256}, {"max_num_seqs": 64}, watch_s=20)
    decision, _ = run(guard, now, 25, per_request_rate=110, in_system=20, kv_usage=0.97)
    assert (decision.outcome, decision.reason) == ("rollback", "kv_usage")
    # Above the range only part of the time: kept.
    guard = ConfigGuard({"max_num_seqs": 64}, window_s=30)
    _, now = run(guard, 0, 30, per_request_rate=100, in_system=20)
    guard.begin(now, {"max_num_seqs": 256}, {"max_num_seqs": 64}, watch_s=20)
    decision, now = run(guard, now, 10, per_request_rate=110, in_system=20, kv_usage=0.97)
    decision, _ = run(guard, now, 15, per_request_rate=110, in_system=20, kv_usage=0.8)
    assert decision.outcome == "stable"


def test_a_low_model_time_share_is_rolled_back() -> None:
    guard = ConfigGuard({"max_num_batched_tokens": 2048}, window_s=30,
                        ranges=HealthRanges(min_model_time_ratio=0.65))
    _, now = run(guard, 0, 30, per_request_rate=100, in_system=20)
    guard.begin(now, {"max_num_batched_tokens": 64}, {"max_num_batched_tokens": 2048}, 20)
    decision, _ = run(guard, now, 25, per_request_rate=100, in_system=20, model_share=0.5)
    assert (decision.outcome, decision.reason) == ("rollback", "model_time_ratio")


def test_a_slower_first_token_is_rolled_back_unless_the_rise_is_noise() -> None:
    """Same throughput, TTFT p90 up 50%: rolled back; up 20% but by 40 ms (under the noise
    floor): kept; up 8% (under the threshold): kept."""
    for ttft_before, ttft_after, outcome in ((0.4, 0.6, "rollback"), (0.2, 0.24, "stable"),
                                             (1.0, 1.08, "stable")):
        guard = ConfigGuard({"max_num_seqs": 64}, window_s=30)
        _, now = run(guard, 0, 30, per_request_rate=100, in_system=20, ttft=ttft_before)
        guard.begin(now, {"max_num_seqs": 96}, {"max_num_seqs": 64}, watch_s=20)
        decision, _ = run(guard, now, 25, per_request_rate=100, in_system=20, ttft=ttft_after)
        assert decision.outcome == outcome, (ttft_before, ttft_after)
        if outcome == "rollback":
            assert decision.reason == "ttft_p90"
            assert decision.after.ttft_p90 == pytest.approx(ttft_after)


def test_no_decision_before_the_watch_ends_and_one_change_at_a_time() -> None:
    guard = ConfigGuard({"max_num_seqs": 64}, window_s=30)
    _, now = run(guard, 0, 30, per_request_rate=100, in_system=20)
    guard.begin(now, {"max_num_seqs": 14}, {"max_num_seqs": 64}, watch_s=20)
    decision, later = run(guard, now, 19, per_request_rate=50, in_system=20)
    assert decision is None and guard.watching
    with pytest.raises(RuntimeError, match="being watched"):
        guard.begin(later, {"max_num_seqs": 8}, {"max_num_seqs": 14}, watch_s=20)
    assert guard.check(now + 20).outcome == "rollback"
    assert not guard.watching


def test_an_idle_server_keeps_the_change() -> None:
    guard = ConfigGuard({"max_num_seqs": 64}, window_s=30)
    guard.begin(0.0, {"max_num_seqs": 14}, {"max_num_seqs": 64}, watch_s=5)
    decision = guard.check(5.0)
    assert (decision.outcome, decision.reason) == ("stable", "no load to compare")


@pytest.mark.parametrize("kwargs", [{"threshold": 0}, {"threshold": 1.5}, {"window_s": 0}])
def test_bad_guard_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ConfigGuard({}, **kwargs)
