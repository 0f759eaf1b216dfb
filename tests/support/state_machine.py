"""The harness of the state machines that drive one pool against a model of it (the KV cache's
and the MemPool's): their hypothesis settings, the core's own invariant check after every
step, and "a failed call changes nothing" against the machine's snapshot of the pool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant

from tests.support.unchanged import Snapshot, assert_unchanged


def machine_settings(max_examples: int) -> settings:
    """Settings for a stateful test: ``max_examples`` runs of up to 40 steps, no deadline (a
    step may run a large batch), and no complaint about slow or heavily filtered draws."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class PoolMachine(RuleBasedStateMachine):
    """A machine over one pool, ``self.pool``: None until its ``@initialize`` rule makes it.

    Subclasses say what is observable (``observe``) and what a failed call may change anyway
    (``allowed_change``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: Any = None

    def observe(self) -> Snapshot:
        raise NotImplementedError

    def allowed_change(self, before: Snapshot, after: Snapshot, error: BaseException) -> None:
        """Nothing, unless a subclass says otherwise (it undoes the change in ``after``)."""

    def expect_unchanged(self, error: type[BaseException], call: Callable[[], object], *,
                         match: str | None = None,
                         before: Snapshot | None = None) -> BaseException:
        """``call()`` raises ``error`` and changes nothing observable (since ``before``)."""
        raised = assert_unchanged(self.observe, error, call, match=match, before=before,
                                  allow=self.allowed_change)
        event(f"raised {type(raised).__name__}")
        return raised

    @invariant()
    def core_invariants(self) -> None:
        """The core's own check of the pool's internal invariants."""
        if self.pool is not None:
            self.pool._check_invariants()
