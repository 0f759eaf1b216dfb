"""The opaque operators a compiled forward calls (attention, rotary tables, bf16 linears),
defined at the dispatcher's lowest cost.

``torch.library.custom_op`` wraps a kernel in Python layers (an autograd kernel, a check that
no output aliases an input, dynamo's disable around the call) that cost ~40 µs a call here,
measured: more than the whole of a decode row's attention in the core (~15 µs). A compiled
step calls these operators once per layer, and a bf16 model on an AVX2 CPU once per linear
(196 times a step on Qwen3-0.6B). So each is a plain kernel of a ``torch.library.Library``
fragment (~4 µs a call), with its fake (meta) function for tracing. Nothing is lost: they
run only inside a compiled inference forward (no autograd), and every kernel here returns
tensors of its own, never a view of an input.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["NAMESPACE", "define_operator"]

NAMESPACE = "atb_mem"

_lock = threading.Lock()
_defined: dict[str, Any] = {}
_library: list[Any] = []
"""The namespace's fragment, made on first use and kept for the process (its operators
live as long as it does)."""


def define_operator(name: str, schema: str, kernel: Callable[..., Any],
                    fake: Callable[..., Any]) -> Any:
    """``torch.ops.atb_mem.<name>.default``, defined on first call with ``schema`` (the
    arguments and results, as ``"(Tensor x, ...) -> Tensor"``): ``kernel`` computes it on every
    device, ``fake`` gives its results' shapes and dtypes while dynamo traces. Later calls
    return the same operator whatever they pass."""
    import torch

    # Called while dynamo traces a forward: a lookup it can trace, no lock (a graph break).
    if name in _defined:
        return _defined[name]
    with _lock:
        if name in _defined:
            return _defined[name]
        if not _library:
            _library.append(torch.library.Library(NAMESPACE, "FRAGMENT"))  # type: ignore[no-untyped-call]
        library = _library[0]
        library.define(name + schema)
        library.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=library)
        operator = getattr(getattr(torch.ops, NAMESPACE), name).default
        _defined[name] = operator
        return operator
