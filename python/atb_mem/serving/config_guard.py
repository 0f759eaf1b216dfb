"""Watching a live configuration change, and undoing one that hurts.

After a change the guard compares the figures of the watch period with those of the window
before it: output tokens per busy second *per request in the system* (throughput normalised by
offered load: a server whose load halves, or that idles part of the window, is not worse; one
that serves each request more slowly is), time-to-first-token p90, preemptions per second, KV
usage and the share of step time spent in the model forward. At the end of the watch period it
decides: **rollback** if throughput fell by more than ``threshold`` (default 10%),
time-to-first-token p90 rose by more than ``threshold`` (and by more than
``HealthRanges.ttft_noise_s``: a p90 of a few requests is noisy), or a health indicator stayed
outside its range for the whole period; otherwise the change becomes the **stable**
configuration. Preemptions per second are compared and reported with the decision; they are not
a trigger of their own, since what they cost shows in the throughput and TTFT.

The guard is pure: time comes in with each :class:`StepSample`, decisions go out as return
values, and the engine loop applies them. That makes it testable with an injected clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ROLLBACK_REASONS", "ConfigGuard", "Decision", "HealthRanges", "StepSample",
           "WindowFigures"]

ROLLBACK_REASONS = ("throughput", "ttft_p90", "kv_usage", "model_time_ratio", "cancelled")


@dataclass(frozen=True)
class HealthRanges:
    """Healthy ranges of the indicators (the ATB tuning articles' figures)."""

    max_kv_usage: float = 0.95
    """KV blocks in use / usable blocks."""
    min_model_time_ratio: float = 0.6
    """Share of step time in the model forward (the kernels' share); lower means the device
    waits on scheduling, copies or Python."""
    ttft_noise_s: float = 0.05
    """A TTFT p90 rise smaller than this is noise, whatever its ratio."""


@dataclass(frozen=True)
class StepSample:
    """One engine step as the loop saw it."""

    now: float
    output_tokens: int
    unfinished: int
    """Requests in the system after the step (waiting or running)."""
    kv_usage: float
    preemptions: int
    """Preemptions during this step."""
    model_seconds: float
    step_seconds: float
    busy_seconds: float
    """The loop's time for this step: its commands, the step and the delivery, not the wait
    for work before them (an idle server is not a slow one)."""
    first_token_latencies: tuple[float, ...] = ()


@dataclass(frozen=True)
class WindowFigures:
    steps: int
    seconds: float
    busy_seconds: float
    throughput: float
    """Output tokens per busy second per request in the system."""
    ttft_p90: float | None
    preemptions_per_s: float
    kv_usage: float
    model_time_ratio: float

    @classmethod
    def of(cls, samples: list[StepSample], start: float, end: float) -> WindowFigures | None:
        """The figures of ``samples`` over ``[start, end]``; None without any load."""
        busy = [sample for sample in samples
                if start <= sample.now <= end and (sample.unfinished or sample.output_tokens)]
        busy_seconds = sum(sample.busy_seconds for sample in busy)
        if not busy or busy_seconds <= 0:
            return None
        in_system = sum(sample.unfinished for sample in busy) / len(busy)
        tokens = sum(sample.output_tokens for sample in busy)
        latencies = sorted(t for sample in busy for t in sample.first_token_latencies)
        step_time = sum(sample.step_seconds for sample in busy)
        return cls(steps=len(busy), seconds=end - start, busy_seconds=busy_seconds,
                   throughput=tokens / busy_seconds / max(in_system, 1.0),
                   ttft_p90=latencies[math.ceil(0.9 * len(latencies)) - 1] if latencies else None,
                   preemptions_per_s=sum(sample.preemptions for sample in busy) / busy_seconds,
                   kv_usage=sum(sample.kv_usage for sample in busy) / len(busy),
                   model_time_ratio=sum(sample.model_seconds for sample in busy)
                   / step_time if step_time > 0 else 1.0)


@dataclass(frozen=True)
class Decision:
    """The end of a watch: ``"rollback"`` (to ``config``, the one before the change) or
    ``"stable"`` (``config`` is the change's), with the reason and the figures."""

    outcome: str
    reason: str
    config: dict[str, Any]
    before: WindowFigures | None
    after: WindowFigures | None


@dataclass
class _Watch:
    changes: dict[str, Any]
    previous: dict[str, Any]
    current: dict[str, Any]
    started: float
    until: float
    before: WindowFigures | None
    samples: list[StepSample] = field(default_factory=list)


class ConfigGuard:
    """Keeps the last ``window_s`` seconds of steps; watches one change at a time."""

    def __init__(self, config: dict[str, Any], *, threshold: float = 0.10,
                 window_s: float = 60.0, ranges: HealthRanges | None = None) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.threshold = threshold
        self.window_s = window_s
        self.ranges = ranges or HealthRanges()
        self.stable = dict(config)
        self.history: list[dict[str, Any]] = []
        self._recent: deque[StepSample] = deque()
        self._watch: _Watch | None = None

    @property
    def watching(self) -> bool:
        return self._watch is not None

    def recent(self) -> WindowFigures | None:
        """The figures of the last ``window_s`` seconds of steps (None without load)."""
        samples = list(self._recent)
        if not samples:
            return None
        return WindowFigures.of(samples, samples[-1].now - self.window_s, samples[-1].now)

    def begin(self, now: float, changes: dict[str, Any], previous: dict[str, Any],
              watch_s: float) -> None:
        """A change was applied at ``now`` (``previous``: the configuration it replaced)."""
        if self._watch is not None:
            raise RuntimeError("a change is being watched already")
        if watch_s <= 0:
            raise ValueError(f"watch_s must be > 0, got {watch_s}")
        before = WindowFigures.of(list(self._recent), now - self.window_s, now)
        self._watch = _Watch(dict(changes), dict(previous), {**previous, **changes}, now,
                             now + watch_s, before)

    def on_step(self, sample: StepSample,
                apply: Callable[[Decision], None] | None = None) -> Decision | None:
        """Records a step; returns the decision when it ends a watch period (see
        :meth:`check` for ``apply``)."""
        self._recent.append(sample)
        while self._recent and self._recent[0].now < sample.now - self.window_s:
            self._recent.popleft()
        if self._watch is not None:
            self._watch.samples.append(sample)
        return self.check(sample.now, apply)

    def check(self, now: float,
              apply: Callable[[Decision], None] | None = None) -> Decision | None:
        """Ends the watch if its period is over (call it when idle too). ``apply`` carries
        the decision out before the guard shows it (``watching`` turns false, ``history``
        and ``stable`` change), so whoever sees it decided sees it done."""
        watch = self._watch
        if watch is None or now < watch.until:
            return None
        outcome, reason = self._judge(watch, WindowFigures.of(watch.samples, watch.started, now))
        return self._end(watch, now, outcome, reason, apply)

    def cancel(self, now: float,
               apply: Callable[[Decision], None] | None = None) -> Decision:
        """Ends the watch at once with a rollback (``reason="cancelled"``), as ``check``
        would end it; ``ValueError`` when no change is watched."""
        watch = self._watch
        if watch is None:
            raise ValueError("no configuration change is being watched")
        return self._end(watch, now, "rollback", "cancelled", apply)

    def _end(self, watch: _Watch, now: float, outcome: str, reason: str,
             apply: Callable[[Decision], None] | None) -> Decision:
        after = WindowFigures.of(watch.samples, watch.started, now)
        decision = Decision(outcome, reason,
                            watch.previous if outcome == "rollback" else watch.current,
                            watch.before, after)
        if apply is not None:
            apply(decision)
        self._watch = None
        if outcome == "stable":
            self.stable = dict(watch.current)
        self.history.append({"at": now, "changes": watch.changes, "outcome": outcome,
                             "reason": reason,
                             "before": asdict(watch.before) if watch.before else None,
                             "after": asdict(after) if after else None})
        return decision

    def _judge(self, watch: _Watch, after: WindowFigures | None) -> tuple[str, str]:
        busy = [sample for sample in watch.samples if sample.unfinished or sample.output_tokens]
        if busy and all(sample.kv_usage > self.ranges.max_kv_usage for sample in busy):
            return "rollback", "kv_usage"
        if busy and all(sample.model_seconds < self.ranges.min_model_time_ratio
                        * sample.step_seconds for sample in busy):
            return "rollback", "model_time_ratio"
        if watch.before is None or after is None:
            return "stable", "no load to compare"
        if after.throughput < (1 - self.threshold) * watch.before.throughput:
            return "rollback", "throughput"
        before_ttft, after_ttft = watch.before.ttft_p90, after.ttft_p90
        if before_ttft is not None and after_ttft is not None \
                and after_ttft > (1 + self.threshold) * before_ttft \
                and after_ttft - before_ttft > self.ranges.ttft_noise_s:
            return "rollback", "ttft_p90"
        return "stable", "held its figures"
