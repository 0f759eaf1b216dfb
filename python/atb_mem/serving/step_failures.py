"""What an ``Engine`` step does when moving blocks or the model's forward fails.

A failure ends the requests it concerns with ``"error"``, never the engine: the others go on.

Moving blocks (swap-out, swap-in, copy-on-write copies, demotions to the host tier) happens
inside the scheduler's step, as one transaction in the core: if the executor raises, the core
rolls the step back and ends exactly the sequences whose bytes the partial execution
destroyed (``BlockMoveError.aborted_seq_ids``; empty when nothing was lost). Their requests
end here, and the step is planned again at once, so the requests that lost nothing do not lose
the step either. A device whose moves keep failing cannot be helped by trying again: after
``MOVE_ATTEMPTS`` tries the error is raised, the engine as it was before the step (less what
the tries ended), and the caller decides (the server fails the requests in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from atb_mem import _core

if TYPE_CHECKING:
    import torch

    from atb_mem.integrations.transformers import ModelRunner
    from atb_mem.scheduling.continuous import ContinuousBatchScheduler, StepPlan

__all__ = ["MOVE_ATTEMPTS", "planned_step", "run_forward"]

MOVE_ATTEMPTS = 3
"""Tries of one step whose moves fail: a passing fault (a transient allocation failure in a
copy) gets another chance, a broken device does not hang the caller."""

FailSequences = Callable[[Iterable[int], str], None]
"""Ends the requests of these sequence ids with this error (ids of no request ignored)."""


def planned_step(scheduler: ContinuousBatchScheduler, fail: FailSequences) -> StepPlan:
    """``scheduler.step()``, planned again after a failed block move has ended the requests
    whose bytes it destroyed; raises the last ``BlockMoveError`` after ``MOVE_ATTEMPTS``."""
    attempt = 1
    while True:
        try:
            return scheduler.step()
        except _core.BlockMoveError as error:
            # The core already ended these sequences (their blocks are freed): their requests'
            # other samples end with them, as a request fails as a whole.
            fail(error.aborted_seq_ids, f"moving its KV-cache blocks failed: "
                                        f"{error.__cause__ or error}")
            if attempt == MOVE_ATTEMPTS:
                raise
            attempt += 1


def run_forward(runner: ModelRunner, plan: StepPlan, fail: FailSequences) -> torch.Tensor | None:
    """The model's logits for ``plan``, or None if the forward raised an ``Exception``: the
    plan's rows would wait for ever for their tokens, so their requests end (their blocks are
    freed, the step reports them). Anything else (a ``KeyboardInterrupt``) ends them too,
    then propagates."""
    try:
        return runner.execute(plan)
    except BaseException as error:
        fail(plan.seq_ids.tolist(), f"the model's forward failed: {error}")
        if not isinstance(error, Exception):
            raise
        return None
