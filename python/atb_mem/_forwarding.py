"""Python classes over Rust ones hold the core object and forward to it, one ``def`` per name.

``KVCachePool`` and ``MemPool`` keep their Rust object as ``_core`` (public as ``core``) and
answer what the core does through methods and properties written out on the class, each
calling ``self._core.<name>(...)``, as polars' ``DataFrame`` does with ``_df``. Written out
rather than generated: ``help()``, the API pages and type checkers see each one's signature
and docstring, and a subclass that overrides one is what gets called. The price would be a
Python frame per call (about 60 ns, as much as the core's own work for an allocation), so
the calls a serving loop makes per request or step are also bound on each instance to the
core's own methods (``bind_forwards``): ``pool.alloc_sequence(...)`` enters Rust directly,
unless a subclass overrides it. Only pure forwards are bound (one call of the core's method
of the same name with the same arguments, checked by the tests), so the two ways in behave
alike.

The forwarding classes hold nothing but forwards, so ``forwards_to`` can check, when the
module is imported, that the core has every name they forward: a name the bindings renamed or
dropped fails at import rather than on the first call.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["bind_forwards", "forwards_to"]

_Class = TypeVar("_Class", bound=type)

# Special methods the core implements and its Python classes answer from it.
_FORWARDED_DUNDERS = frozenset({"__len__", "__contains__", "__repr__"})


def forwards_to(core_type: type) -> Callable[[_Class], _Class]:
    """Checks that ``core_type`` has every method and property the decorated class defines
    (its public ones, the private ones it forwards, and ``__len__``, ``__contains__``,
    ``__repr__``); raises TypeError naming the ones it lacks."""

    def check(cls: _Class) -> _Class:
        missing = [name for name, member in vars(cls).items()
                   if isinstance(member, (types.FunctionType, property))
                   and (not name.startswith("__") or name in _FORWARDED_DUNDERS)
                   and not hasattr(core_type, name)]
        if missing:
            raise TypeError(f"{cls.__qualname__} forwards {missing} to "
                            f"{core_type.__qualname__}, which has no such member")
        return cls

    return check


def bind_forwards(instance: object, base: type, names: Iterable[str]) -> None:
    """Sets each of ``names`` on ``instance`` to its core's (``instance._core``) bound method,
    where ``instance``'s class takes that forward from ``base`` (a subclass's override stays
    what gets called)."""
    core = instance._core  # type: ignore[attr-defined]
    cls = type(instance)
    for name in names:
        if getattr(cls, name) is getattr(base, name):
            setattr(instance, name, getattr(core, name))
