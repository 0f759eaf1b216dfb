"""`_core.pyi` describes exactly what the extension exports, with the same signatures (the
shapes of the dicts it returns are checked in test_types.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import atb_mem
from atb_mem import _core

STUB = Path(atb_mem.__file__).with_name("_core.pyi")
TYPE_ALIASES = {"Int32Array", "IntsLike", "MoveExecutor", "SeqIdsLike", "TokenIdsLike"}
# Slots every pyclass carries that the stub need not repeat.
IMPLICIT = {"__doc__", "__module__", "__new__", "__repr__", "__dict__", "__weakref__",
            "__init__", "__hash__", "__getattribute__", "__delattr__", "__setattr__",
            "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"}


def stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text())


def stub_classes() -> dict[str, ast.ClassDef]:
    return {node.name: node for node in stub_tree().body if isinstance(node, ast.ClassDef)}


def test_py_typed_marker_ships() -> None:
    assert STUB.with_name("py.typed").exists()


def test_module_names_match() -> None:
    stub_names = set(TYPE_ALIASES)
    for node in stub_tree().body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            stub_names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stub_names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            stub_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    runtime = {name for name in dir(_core) if not name.startswith("__") or name == "__version__"}
    assert runtime - {"_core"} == stub_names - TYPE_ALIASES


@pytest.mark.parametrize("name", ["KVCachePool", "BatchTable", "MemPool", "Allocation",
                                  "RequestBatcher", "ContinuousScheduler",
                                  "HostRegion"])
def test_class_members_and_signatures_match(name: str) -> None:
    stub = stub_classes()[name]
    runtime_class = getattr(_core, name)
    runtime = {member for member in vars(runtime_class) if member not in IMPLICIT}
    stub_members = {node.name for node in stub.body if isinstance(node, ast.FunctionDef)}
    assert runtime == stub_members - IMPLICIT
    for node in stub.body:
        if not isinstance(node, ast.FunctionDef) or node.name in IMPLICIT:
            continue
        member = vars(runtime_class)[node.name]
        is_property = any(isinstance(d, ast.Name) and d.id == "property"
                          for d in node.decorator_list)
        assert is_property == inspect.isdatadescriptor(member), node.name
        if is_property:
            continue
        params = [a.arg for a in node.args.args + node.args.kwonlyargs]
        runtime_params = list(inspect.signature(member).parameters)
        if node.name.startswith("__"):  # slot wrappers name their parameters themselves
            assert len(runtime_params) == len(params), node.name
        else:
            assert runtime_params == params, node.name


@pytest.mark.parametrize("name", ["KVCachePool", "MemPool", "HostRegion"])
def test_constructor_signature_matches(name: str) -> None:
    stub = stub_classes()[name]
    new = next(n for n in stub.body if isinstance(n, ast.FunctionDef) and n.name == "__new__")
    stub_params = [a.arg for a in new.args.args[1:] + new.args.kwonlyargs]
    runtime_params = list(inspect.signature(getattr(_core, name)).parameters)
    assert runtime_params == stub_params


def test_the_stubs_eviction_policy_names_are_the_cores() -> None:
    """The core owns the names (``_core.EVICTION_POLICIES``); the typed places that must
    spell them out as a Literal (the stub, and ``KVCachePool``'s forward of it) say the same."""
    import typing

    from atb_mem.kv.block_bookkeeping import BlockBookkeeping

    assert _core.EVICTION_POLICIES == ("lru", "lfu", "slru", "priority")
    literals = [node for node in ast.walk(ast.parse(STUB.read_text()))
                if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal"
                and "'lru'" in ast.unparse(node.slice)]
    assert len(literals) >= 2
    for node in literals:
        assert tuple(ast.literal_eval(node.slice)) == _core.EVICTION_POLICIES
    hints = typing.get_type_hints(BlockBookkeeping.eviction_policy.fget)  # type: ignore[attr-defined]
    assert typing.get_args(hints["return"]) == _core.EVICTION_POLICIES
