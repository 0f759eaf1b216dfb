"""The settings a running server can change live, as one configuration.

Two schedulers take them: the engine's ``ContinuousScheduler`` (``max_num_seqs``,
``max_num_batched_tokens``, ``watermark``, ``preemption``, ...) and, when the server batches
requests on admission, the ``DynamicBatchScheduler`` in front of the engine
(``max_batch_size``, ``timeout_ms``). A change may touch both; it is checked against both
before either is touched, so a bad value anywhere changes nothing.
"""

from __future__ import annotations

from typing import Any

from atb_mem.scheduling.continuous import ContinuousBatchScheduler
from atb_mem.scheduling.request_batching import DynamicBatchScheduler

__all__ = ["ADMISSION_SETTINGS", "LiveSettings"]

ADMISSION_SETTINGS = ("max_batch_size", "timeout_ms")


class LiveSettings:
    """``scheduler``'s settings, and ``admission``'s ``ADMISSION_SETTINGS`` when there is one."""

    def __init__(self, scheduler: ContinuousBatchScheduler,
                 admission: DynamicBatchScheduler | None = None) -> None:
        self.scheduler = scheduler
        self.admission = admission

    def _split(self, changes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        admitting = {key: value for key, value in changes.items()
                     if key in ADMISSION_SETTINGS}
        if admitting and self.admission is None:
            raise ValueError(f"{sorted(admitting)} set(s) the admission batcher, and this "
                             "server admits requests as they come: start it with "
                             "--max-batch-size to batch them")
        scheduling = {key: value for key, value in changes.items() if key not in admitting}
        return scheduling, admitting

    def _admission_part(self, config: Any) -> dict[str, Any]:
        return {key: config[key] for key in ADMISSION_SETTINGS}

    def check(self, **changes: Any) -> dict[str, Any]:
        """The configuration ``changes`` would make, validated (``ValueError``/``TypeError``
        otherwise); changes nothing. Without changes: what the next step runs with."""
        scheduling, admitting = self._split(changes)
        config = dict(self.scheduler.check_settings(**scheduling))
        if self.admission is not None:
            config |= self._admission_part(self.admission.check_settings(**admitting))
        return config

    def apply(self, **changes: Any) -> dict[str, Any]:
        """Applies ``changes`` (the scheduler's at its next step, the batcher's at its next
        batch), all or nothing; returns the configuration they replace, which ``apply``
        takes back for a rollback."""
        previous = self.check()
        self.check(**changes)  # both schedulers' checks, before either changes
        scheduling, admitting = self._split(changes)
        if self.admission is not None:
            self.admission.reconfigure(**admitting)
        self.scheduler.reconfigure(**scheduling)
        return previous
