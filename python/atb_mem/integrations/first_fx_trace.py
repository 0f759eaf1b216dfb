"""torch.fx's one symbolic trace in inductor, done before an Engine serves.

While ``torch.fx``'s symbolic tracer traces, it patches ``torch.nn.Module.__call__`` for the
whole process, so that it can record submodule calls. Inductor traces a dummy function that
way once per process, the first time any thread lowers a graph
(``torch._inductor.loop_body.InterpreterShim``, cached). An Engine serving eager on another
thread at that moment has its modules' calls go through the patch, which refuses modules it
is not tracing: its step fails (``module is not installed as a submodule``), seen when a second
Engine was built beside a first one that served. Traced here, before an Engine's first forward,
torch never traces it again.
"""

from __future__ import annotations

import functools
import logging

__all__ = ["trace_inductors_dummy_once"]

logger = logging.getLogger(__name__)


@functools.cache
def trace_inductors_dummy_once() -> bool:
    """Has inductor trace its dummy function now (once per process); False where this torch
    has no such function (nothing known to settle), or no inductor."""
    try:
        from torch._inductor.loop_body import InterpreterShim
        InterpreterShim._dummy_gm()
    except Exception as error:  # another torch: its internals are not this one's
        logger.debug("atb-mem: inductor's first symbolic trace not settled: %s", error)
        return False
    return True
