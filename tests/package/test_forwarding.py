"""The Python classes over Rust ones hold their core and forward to it with methods written
out on the class (``atb_mem._forwarding``): every member of the core is there, with the
stub's signature and docstring, and a subclass's override is what gets called."""

from __future__ import annotations

import ast
import inspect
import pydoc
from pathlib import Path

import pytest

import atb_mem
from atb_mem import _core
from atb_mem._forwarding import forwards_to
from atb_mem.scheduling.continuous import ContinuousBatchScheduler

STUB = Path(atb_mem.__file__).with_name("_core.pyi")
PAIRS = [(atb_mem.KVCachePool, _core.KVCachePool), (atb_mem.MemPool, _core.MemPool)]
FORWARDED_DUNDERS = ("__len__", "__contains__", "__repr__")
# Private members of the cores and why a Python class does not forward them; every other
# private member is forwarded (tests and the tiers call it through the class).
NOT_FORWARDED = {
    (_core.KVCachePool, "_groups"): "KVCachePool.groups wraps it as KVCacheGroup tuples",
    (_core.KVCachePool, "_state_groups"): "KVCachePool.state_groups wraps it as StateGroups",
    (_core.KVCachePool, "_explain_prefix"): "KVCachePool.explain_prefix wraps it as a "
                                            "PrefixExplanation",
}
# Members the Python class defines itself, doing more than the core's (not forwards).
OWN = {(atb_mem.KVCachePool, name) for name in ("swap_out", "swap_in", "stats")} | {
    (atb_mem.MemPool, "close")}  # MemPool.close is the core's, KVCachePool's its own


def class_member(cls: type, name: str) -> object | None:
    """``name`` as the class (not an instance) defines it, through its bases."""
    return next((vars(klass)[name] for klass in cls.__mro__[:-1] if name in vars(klass)), None)


def core_members(core_type: type) -> list[str]:
    return [name for name in dir(core_type)
            if not name.startswith("__") or (name in FORWARDED_DUNDERS
                                              and name in vars(core_type))]


def stub_members(core_type: type) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(STUB.read_text())
    stub = next(node for node in tree.body
                if isinstance(node, ast.ClassDef) and node.name == core_type.__name__)
    return {node.name: node for node in stub.body if isinstance(node, ast.FunctionDef)}


def forwards(cls: type, core_type: type) -> list[str]:
    return [name for name in core_members(core_type)
            if (core_type, name) not in NOT_FORWARDED and (cls, name) not in OWN]


def normalized(annotation: str | None) -> str | None:
    return None if annotation is None else ast.unparse(ast.parse(annotation))


@pytest.mark.parametrize("cls, core_type", PAIRS)
def test_every_core_member_is_on_the_class_itself(cls, core_type) -> None:
    missing = [name for name in core_members(core_type)
               if (core_type, name) not in NOT_FORWARDED and class_member(cls, name) is None]
    assert not missing, f"{cls.__name__} does not define {missing}"
    for core_type_, name in NOT_FORWARDED:
        assert hasattr(core_type_, name), f"{name} is gone from the core: drop it here"
    for name in core_members(core_type):
        member = class_member(cls, name)
        if member is not None:  # a property where the core has one, a method where it has one
            is_property = inspect.isdatadescriptor(getattr(core_type, name))
            assert isinstance(member, property) == is_property, name


@pytest.mark.parametrize("cls, core_type", PAIRS)
def test_forwards_have_the_stubs_signature_and_docstring(cls, core_type) -> None:
    stubs = stub_members(core_type)
    for name in forwards(cls, core_type):
        if name == "__repr__":  # the stub leaves out what every pyclass has
            continue
        member = class_member(cls, name)
        stub = stubs[name]
        if isinstance(member, property):
            assert member.fget is not None
            function, stub_doc = member.fget, ast.get_docstring(stub)
        else:
            assert inspect.isfunction(member), name
            function, stub_doc = member, ast.get_docstring(stub)
        if stub_doc is not None:
            assert inspect.getdoc(function) == stub_doc, name
        elif not name.startswith("__"):
            assert inspect.getdoc(function), f"{name} has no docstring"
        signature = inspect.signature(function)
        stub_args = stub.args.posonlyargs + stub.args.args + stub.args.kwonlyargs
        assert [(p.name, p.kind == p.KEYWORD_ONLY) for p in signature.parameters.values()] \
            == [(a.arg, a in stub.args.kwonlyargs) for a in stub_args], name
        for parameter, arg in zip(list(signature.parameters.values())[1:], stub_args[1:],
                                  strict=True):
            assert normalized(parameter.annotation) == ast.unparse(arg.annotation), name
        assert normalized(signature.return_annotation) == ast.unparse(stub.returns), name


def test_help_shows_a_forward_with_its_parameters() -> None:
    signature = inspect.signature(atb_mem.KVCachePool.alloc_sequence)
    assert list(signature.parameters) == ["self", "seq_id", "tokens", "cache_salt"]
    assert signature.parameters["cache_salt"].kind is inspect.Parameter.KEYWORD_ONLY
    text = pydoc.render_doc(atb_mem.KVCachePool, renderer=pydoc.plaintext)
    assert "alloc_sequence(self, seq_id: 'int', tokens: 'int | TokenIdsLike', *" in text
    assert "Allocates blocks for a new sequence" in text
    assert "malloc(self, size: 'int') -> 'Allocation'" in \
        pydoc.render_doc(atb_mem.MemPool, renderer=pydoc.plaintext)


def test_a_subclass_override_is_what_gets_called() -> None:
    calls: list[int] = []

    class Counting(atb_mem.KVCachePool):
        def alloc_sequence(self, seq_id, tokens, *, cache_salt=None):  # type: ignore[override]
            calls.append(seq_id)
            return super().alloc_sequence(seq_id, tokens, cache_salt=cache_salt)

        @property
        def num_free_blocks(self) -> int:
            return -1

    kv = Counting(16, 4, device=None)
    assert kv.alloc_sequence(3, 9) == 0
    assert calls == [3] and 3 in kv and kv.seq_len(3) == 9
    assert kv.num_free_blocks == -1 and kv.core.num_free_blocks == 12


def test_a_forward_to_a_name_the_core_lacks_fails_at_import() -> None:
    class Renamed:
        def alloc_sequence(self) -> None: ...

        def allocate(self) -> None: ...

        @property
        def num_blocks(self) -> int: ...

        def __len__(self) -> int: ...

        def __init__(self) -> None: ...  # not a forward

    with pytest.raises(TypeError, match=r"Renamed forwards \['allocate'\] to KVCachePool"):
        forwards_to(_core.KVCachePool)(Renamed)


@pytest.mark.parametrize("make, core_type", [
    (lambda: atb_mem.KVCachePool(16, 4, device=None), _core.KVCachePool),
    (lambda: atb_mem.KVCachePool(16, 4), _core.KVCachePool),
    (lambda: atb_mem.MemPool(1 << 16), _core.MemPool),
])
def test_pools_hold_their_core(make, core_type) -> None:
    pool = make()
    assert not isinstance(pool, core_type)
    assert type(pool.core) is core_type
    # Per instance, only the hot calls are bound (to the core's own methods).
    assert set(vars(pool)) & set(core_members(core_type)) == set(type(pool).BOUND_FORWARDS)
    assert repr(pool) == repr(pool.core)
    assert len(pool) == len(pool.core) == 0


def test_forwarded_properties_read_the_core_now() -> None:
    kv = atb_mem.KVCachePool(16, 4, device=None)
    free = kv.num_free_blocks
    kv.alloc_sequence(7, 9)
    assert kv.num_free_blocks == free - 3 == kv.core.num_free_blocks
    assert 7 in kv and 8 not in kv and len(kv) == 1 == len(kv.core)
    assert kv.stats()["num_sequences"] == 1
    kv._check_invariants()


def test_what_the_python_class_adds_is_its_own() -> None:
    kv = atb_mem.KVCachePool(16, 4, num_host_blocks=4)
    kv.alloc_sequence(1, 5)
    # swap_out and stats are the Python class's (they add the executor and the bytes).
    assert "swap_out" in vars(atb_mem.KVCachePool)
    pairs = kv.swap_out([1])
    assert len(pairs) == 2 and kv.is_swapped(1)
    assert kv.stats()["bytes_device"] == 16 * kv.bytes_per_block


def test_the_scheduler_takes_a_pool_or_its_core_and_nothing_else() -> None:
    kv = atb_mem.KVCachePool(16, 4, device=None)
    config = ContinuousBatchScheduler(kv).config
    assert _core.ContinuousScheduler(kv.core, config).config() == config
    with pytest.raises(TypeError, match="KVCachePool"):
        _core.ContinuousScheduler(kv, config)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="KVCachePool"):
        ContinuousBatchScheduler(object())  # type: ignore[arg-type]


BOUND = [(atb_mem.KVCachePool, _core.KVCachePool), (atb_mem.MemPool, _core.MemPool)]


def is_pure_forward(function: object, name: str) -> bool:
    """Whether ``function``'s body (past its docstring) is one call of ``self._core.<name>``
    with its own parameters, in order, keyword-only ones by keyword, returned or not."""
    tree = ast.parse(inspect.getsource(function).strip()).body[0]  # type: ignore[arg-type]
    assert isinstance(tree, ast.FunctionDef)
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
        return False
    call = body[0].value
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == f"self._core.{name}"):
        return False
    args = tree.args
    positional = [a.arg for a in args.posonlyargs + args.args][1:]
    return [ast.unparse(a) for a in call.args] == positional and \
        [(k.arg, ast.unparse(k.value)) for k in call.keywords] == \
        [(a.arg, a.arg) for a in args.kwonlyargs]


@pytest.mark.parametrize("cls, core_type", BOUND)
def test_bound_forwards_are_pure_and_the_instance_calls_the_core_directly(
        cls, core_type) -> None:
    """The hot calls go straight to Rust from an instance (no Python frame: W1 through the
    pool costs what it costs through ``core``), and only where the class's forward does
    nothing but that call, so both ways behave alike."""
    instance = cls(64, 4, device=None) if cls is atb_mem.KVCachePool else cls(1 << 16)
    assert cls.BOUND_FORWARDS
    for name in cls.BOUND_FORWARDS:
        assert is_pure_forward(class_member(cls, name), name), name
        bound = getattr(instance, name)
        assert inspect.isbuiltin(bound) and bound.__self__ is instance.core, name
        assert bound.__name__ == name


def test_a_pure_forward_check_can_fail() -> None:
    class Impure:
        _core: object

        def alloc_sequence(self, seq_id, tokens, *, cache_salt=None):
            return self._core.alloc_sequence(tokens, seq_id, cache_salt=cache_salt)

        def free_sequence(self, seq_id):
            seq_id += 1
            self._core.free_sequence(seq_id)

    assert not is_pure_forward(Impure.alloc_sequence, "alloc_sequence")
    assert not is_pure_forward(Impure.free_sequence, "free_sequence")
    assert is_pure_forward(atb_mem.KVCachePool.alloc_sequence, "alloc_sequence")


def test_a_bound_forward_keeps_a_subclass_override_and_errors_alike() -> None:
    class Counting(atb_mem.KVCachePool):
        def free_sequence(self, seq_id):  # type: ignore[override]
            return super().free_sequence(seq_id)

    kv = Counting(16, 4, device=None)
    assert inspect.ismethod(kv.free_sequence) and inspect.isbuiltin(kv.alloc_sequence)
    with pytest.raises(Exception) as through_pool:
        kv.alloc_sequence(1, 10_000)
    with pytest.raises(Exception) as through_core:
        kv.core.alloc_sequence(1, 10_000)
    assert type(through_pool.value) is type(through_core.value)
    assert str(through_pool.value) == str(through_core.value)
    assert len(kv) == 0
