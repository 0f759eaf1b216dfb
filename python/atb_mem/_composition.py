"""Python classes that hold a core object instead of subclassing it.

Every Python class over a Rust one works the same way: it keeps the Rust object as ``_core``
(the schedulers' is private; the pools' is public as ``core``, which the scheduler hands to
``_core.ContinuousScheduler``), defines what it adds, and answers the rest from the core.

The rest is bound per instance rather than wrapped: ``composed`` makes each of the core's
properties a property that reads the core, and ``bind_core`` sets each core method the class
does not define itself on the instance as the core's own bound method. A call then costs
what calling the core costs — no Python frame in between — which matters for the
one-sequence calls (``alloc_sequence``, ``free_sequence``) that run millions of times.

Type checkers are told the class has the core's interface (a ``_CoreInterface`` base under
``TYPE_CHECKING``): at runtime it is not a subclass, so what needs the Rust object gets
``core``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["bind_core", "composed"]

_Class = TypeVar("_Class", bound=type)

# Special methods are looked up on the type, so these are forwarded by the class.
_FORWARDED_DUNDERS = ("__len__", "__contains__", "__repr__")


def composed(core_type: type) -> Callable[[_Class], _Class]:
    """Makes ``cls`` answer from ``self._core`` what it does not define: the core's
    properties (read through the core), methods (bound by ``bind_core``), ``__len__``,
    ``__contains__`` and ``__repr__``."""

    def decorate(cls: _Class) -> _Class:
        methods = []
        for name, member in vars(core_type).items():
            if name.startswith("__") or name in vars(cls):
                continue
            if isinstance(member, (types.GetSetDescriptorType, property)):
                setattr(cls, name, _core_property(name, member.__doc__))
            elif callable(member):
                methods.append(name)
        for name in _FORWARDED_DUNDERS:
            if name in vars(core_type) and name not in vars(cls):
                setattr(cls, name, _core_dunder(name))
        cls._core_methods = tuple(methods)  # type: ignore[attr-defined]
        return cls

    return decorate


def bind_core(instance: Any) -> None:
    """Sets the core's methods on ``instance`` (which holds its core as ``_core``) as the
    core's own bound methods (see the module)."""
    core = instance._core
    for name in type(instance)._core_methods:
        object.__setattr__(instance, name, getattr(core, name))


def _core_property(name: str, doc: str | None) -> property:
    def read(self: Any) -> Any:
        return getattr(self._core, name)

    read.__name__ = name
    return property(read, doc=doc)


def _core_dunder(name: str) -> Callable[..., Any]:
    def forward(self: Any, *args: Any) -> Any:
        return getattr(self._core, name)(*args)

    forward.__name__ = name
    return forward
