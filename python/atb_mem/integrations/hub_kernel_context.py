"""The ``kernels`` package's context variable made safe for threads, before an Engine runs a
transformers model.

transformers (≥ 5) requires ``kernels`` and decorates its attention classes with
``use_kernelized_func``: every attention forward sets ``kernels``' ``_ACTIVE_KERNEL_FUNCS``,
and every call of a function such as ``apply_rotary_pos_emb`` reads it. That variable
(``CompileableContextVar``, kernels 0.19.1 and earlier) becomes one global for the whole process
whenever ``torch.compiler.is_compiling()`` is true — a flag held while *any* thread compiles —
and stays global until a reset with ``None``. An eager forward in one thread that sets it
before another thread's compile starts and resets it after puts its own ``contextvars.Token``
into the global; from then on every eager forward of such a model in the process fails
(``TypeError: '_contextvars.Token' object is not iterable``), and so does every later compile.
Reproduced with transformers alone (an eager model in one thread, ``torch.compile`` of another
in the next): the process never recovers.

An Engine serves while other threads compile (a second Engine being built, user code), so
before its first forward the Engine swaps that variable for :class:`PerThreadKernelFuncs`,
once per process, and logs that it did: eager calls keep to their own context, as
``kernels`` means them to, and only code that dynamo traces in this thread
(``torch.compiler.is_dynamo_compiling()``) uses the global, as ``kernels`` does while
tracing. Nothing else changes: a ``kernels`` whose variable is not that class (a fixed
release) is left alone.
"""

from __future__ import annotations

import functools
import logging
import threading
from contextvars import ContextVar, Token
from typing import Any

__all__ = ["PerThreadKernelFuncs", "make_kernel_funcs_per_thread"]

_log = logging.getLogger(__name__)


class PerThreadKernelFuncs:
    """``kernels``' ``CompileableContextVar`` whose test for "compiling" is this thread's
    trace, not the process-wide flag. ``get``, ``set`` and ``reset`` keep its signatures."""

    def __init__(self, context_var: ContextVar[Any]) -> None:
        self.context_var = context_var
        self.global_var: Any = None
        """What a trace reads and writes (dynamo cannot trace a ``ContextVar``)."""

    def get(self) -> Any:
        import torch

        if torch.compiler.is_dynamo_compiling():
            return self.global_var
        return self.context_var.get()

    def set(self, value: Any) -> Any:
        import torch

        if torch.compiler.is_dynamo_compiling():
            previous = self.global_var
            self.global_var = value
            return previous
        return self.context_var.set(value)

    def reset(self, token: Any) -> None:
        import torch

        if isinstance(token, Token) and not torch.compiler.is_dynamo_compiling():
            self.context_var.reset(token)
        else:  # what a trace's ``set`` returned (reset eagerly after a graph break, or traced)
            self.global_var = token


_swap = threading.Lock()


@functools.cache
def make_kernel_funcs_per_thread() -> bool:
    """Swaps ``kernels``' ``_ACTIVE_KERNEL_FUNCS`` for a :class:`PerThreadKernelFuncs` over
    the same ``ContextVar`` (once per process); returns whether it did."""
    try:
        from kernels._internals.layer import layer
    except ImportError:  # no kernels, or one laid out otherwise: nothing of this bug
        return False
    with _swap:
        current = getattr(layer, "_ACTIVE_KERNEL_FUNCS", None)
        context_var = getattr(current, "context_var", None)
        if type(current).__name__ != "CompileableContextVar" or \
                not isinstance(context_var, ContextVar):
            return isinstance(current, PerThreadKernelFuncs)
        layer._ACTIVE_KERNEL_FUNCS = PerThreadKernelFuncs(context_var)
    _log.info("atb-mem: kernels' _ACTIVE_KERNEL_FUNCS is now per thread (kernels' own is one "
              "global for the process while any thread compiles; see docs/serving.md)")
    return True
