"""A model's attention implementation switched to atb-mem's only while a step runs.

transformers reads ``config._attn_implementation`` at every forward: each layer looks its
attention function up by that name, and the model builds the mask that name needs (none for
a name without a mask function, as atb-mem's). An engine that switched the model for good
would take it over: the user's own ``model.generate`` would reach the paged attention outside
any step. Switching the name for the length of each step instead leaves the model, between
steps, exactly as transformers made it (its sdpa or eager attention, its masks, its caches),
so ``model.generate`` gives HF's tokens on the very object the engine serves.

Why not one name for good, with functions that pick paged or the previous implementation by
whether a step is active: that name would also need a mask function, and transformers then
checks the step's positions for packed sequences before every forward (a device sync per
step); and every other test of the name in transformers would see atb-mem's, not the model's.

The switch writes the name into the configs directly: ``set_attn_implementation`` walks every
module and validates, too slow for every step, so it runs once, at start-up, to validate and
to find the configs it changes. Each step puts back what it found, so an implementation the
user sets between steps is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["AttentionSwitch"]

# What ``config._attn_implementation`` reads (and ``set_attn_implementation`` writes) in
# transformers 5; its setter would also reach into sub-configs that the model may not switch.
_NAME = "_attn_implementation_internal"


class AttentionSwitch:
    """Registers ``forward`` as attention ``name`` and switches ``model`` to it inside
    :meth:`active` only. Raises as ``set_attn_implementation`` does for a model that cannot
    take it; the model is left as it was."""

    def __init__(self, model: Any, name: str, forward: Callable[..., Any]) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(name, forward)
        configs = _configs(model)
        before = [getattr(config, _NAME, None) for config in configs]
        try:
            model.set_attn_implementation(name)
            self.configs = [config for config in configs if getattr(config, _NAME, None) == name]
        finally:
            for config, value in zip(configs, before, strict=True):
                setattr(config, _NAME, value)
        self.name = name

    @contextmanager
    def active(self) -> Iterator[None]:
        """The model's attention is ``name`` while the block runs."""
        before = [getattr(config, _NAME) for config in self.configs]
        for config in self.configs:
            setattr(config, _NAME, self.name)
        try:
            yield
        finally:
            for config, value in zip(self.configs, before, strict=True):
                setattr(config, _NAME, value)


def _configs(model: Any) -> list[Any]:
    """Every config ``set_attn_implementation`` may change, once each: the configs of the
    model's transformers submodels and, at any depth, their sub-configs."""
    from transformers import PreTrainedModel

    found: dict[int, Any] = {}
    pending = [module.config for module in model.modules() if isinstance(module, PreTrainedModel)]
    while pending:
        config = pending.pop()
        if id(config) not in found:
            found[id(config)] = config
            pending += [sub for key in getattr(config, "sub_configs", {})
                        if (sub := getattr(config, key, None)) is not None]
    return list(found.values())
