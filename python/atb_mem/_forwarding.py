"""Python classes over Rust ones hold the core object and forward to it, one ``def`` per name.

``KVCachePool`` and ``MemPool`` keep their Rust object as ``_core`` (public as ``core``) and
answer what the core does through methods and properties written out on the class, each
calling ``self._core.<name>(...)``, as polars' ``DataFrame`` does with ``_df``. Written out
rather than generated: ``help()``, the API pages and type checkers see each one's signature
and docstring, and a subclass that overrides one is what gets called. The price is a Python
frame per call, so a loop that makes millions of them calls ``core`` instead.

The forwarding classes hold nothing but forwards, so ``forwards_to`` can check, when the
module is imported, that the core has every name they forward: a name the bindings renamed or
dropped fails at import rather than on the first call.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TypeVar

__all__ = ["forwards_to"]

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
