"""``kernels``' context variable under another thread's compile, and atb-mem's per-thread one.

transformers' attention classes set ``kernels``' ``_ACTIVE_KERNEL_FUNCS`` around every forward.
kernels' own variable turns into one process-wide global while any thread compiles; a thread
that set it before another thread's compile began and resets it after leaves its
``contextvars.Token`` in that global, and every later eager forward in the process fails. The
interleaving is played here on each variable, with torch's process-wide "compiling" flag
raised while the second thread sets it, as a compile in that thread raises it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

# transformers (>= 5) requires kernels: a kernels without this module fails here, on purpose.
from kernels._internals.layer import layer

from atb_mem.integrations.hub_kernel_context import (
    PerThreadKernelFuncs,
    make_kernel_funcs_per_thread,
)
from tests.support.models import model_pair, random_prompt, require_torch


def interleave(variable: Any) -> None:
    """Thread A sets the variable before thread B's compile starts and resets it after B,
    compiling, set it too."""
    torch = require_torch()
    token = variable.set({})
    assert not torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        other = threading.Thread(target=variable.set, args=({"thread B": None},))
        other.start()
        other.join(timeout=60)
        assert not other.is_alive()
    finally:
        torch.compiler._is_compiling_flag = False
    variable.reset(token)


def forward_with(variable: Any) -> tuple[Any, Any]:
    """A Llama's logits eagerly with ``variable`` as kernels' active functions, and without
    the interleaving (kernels' own variable, untouched)."""
    torch = require_torch()
    model, _ = model_pair("llama")
    tokens = torch.tensor([random_prompt(5, 9)])
    with torch.inference_mode():
        expected = model(tokens).logits
    held = layer._ACTIVE_KERNEL_FUNCS
    layer._ACTIVE_KERNEL_FUNCS = variable
    try:
        interleave(variable)
        with torch.inference_mode():
            return model(tokens).logits, expected
    finally:
        layer._ACTIVE_KERNEL_FUNCS = held


def test_kernels_own_variable_breaks_every_later_eager_forward() -> None:
    """The negative control: the defect atb-mem works around is there in kernels' own class."""
    kernels_own = layer.CompileableContextVar("kernels' own")
    with pytest.raises(TypeError, match="Token"):
        forward_with(kernels_own)


def test_the_per_thread_variable_keeps_eager_forwards_right() -> None:
    torch = require_torch()
    from contextvars import ContextVar

    got, expected = forward_with(PerThreadKernelFuncs(ContextVar("per thread", default=None)))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_an_engine_swaps_kernels_variable_once_keeping_its_context() -> None:
    from atb_mem.serving import Engine

    model, _ = model_pair("llama")
    Engine(model, num_blocks=16, block_size=4, enforce_eager=True)
    swapped = layer._ACTIVE_KERNEL_FUNCS
    assert isinstance(swapped, PerThreadKernelFuncs)
    assert make_kernel_funcs_per_thread() is True
    assert layer._ACTIVE_KERNEL_FUNCS is swapped
    # The same ContextVar: a forward that set kernels' variable before the swap resets it after.
    assert swapped.context_var.name == "_ACTIVE_KERNEL_FUNCS"
