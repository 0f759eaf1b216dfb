"""The TypedDicts and Literals of ``atb_mem._types`` say what the code really returns and
accepts: every TypedDict is checked key by key, value by value, against a dict the binding or
a Python class returns; the stub and the Python methods are checked to name them; every
Literal is checked against what the binding accepts and reports."""

from __future__ import annotations

import ast
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest

import atb_mem
from atb_mem import _core, _types
from atb_mem.memory.backends import NumpyBackend, TorchBackend
from tests.package.test_stubs import stub_classes


def conforms(value: object, hint: Any) -> bool:
    """Whether ``value`` is of the type ``hint`` (the kinds of hint ``_types`` uses)."""
    origin = get_origin(hint)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in get_args(hint)
    if origin in (Union, types.UnionType):
        return any(conforms(value, arm) for arm in get_args(hint))
    if origin is list:
        return isinstance(value, list) and all(conforms(v, get_args(hint)[0]) for v in value)
    if origin is tuple:  # tuple[X, ...]
        return isinstance(value, tuple) and all(conforms(v, get_args(hint)[0]) for v in value)
    if hint is float:  # an int is a float to a type checker
        return type(value) in (int, float)
    if hint in (int, bool, str):
        return type(value) is hint
    raise AssertionError(f"no check for the hint {hint!r}")


def assert_shape(typed_dict: Any, value: object) -> None:
    assert typing.is_typeddict(typed_dict)
    assert isinstance(value, dict)
    hints = get_type_hints(typed_dict)
    assert set(value) == set(hints), (
        f"{typed_dict.__name__}: missing {sorted(set(hints) - set(value))}, "
        f"not declared {sorted(set(value) - set(hints))}")
    for key, hint in hints.items():
        assert conforms(value[key], hint), f"{typed_dict.__name__}[{key!r}] = {value[key]!r}"


def busy_cache() -> atb_mem.KVCachePool:
    kv = atb_mem.KVCachePool(32, 4, num_host_blocks=8)
    kv.alloc_sequence(1, list(range(9)))
    kv.mark_computed(1)
    kv.alloc_sequence(2, list(range(9)))
    kv.swap_out([2])
    return kv


def scheduler() -> atb_mem.ContinuousBatchScheduler:
    sched = atb_mem.ContinuousBatchScheduler(atb_mem.KVCachePool(32, 4, device=None))
    sched.add_request(1, 6, 2)
    sched.step(now=0.0)
    return sched


def batcher() -> atb_mem.DynamicBatchScheduler:
    batch = atb_mem.DynamicBatchScheduler(max_batch_size=2, max_queue_size=8,
                                          default_timeout_ms=5.0, preferred_batch_sizes=[1])
    batch.submit("x")
    return batch


def mem_pool() -> atb_mem.MemPool:
    pool = atb_mem.MemPool(1 << 16, policy="ascend")
    pool.malloc(100)
    return pool


RETURNED: list[tuple[Any, Callable[[], object]]] = [
    (_types.KVCacheStats, lambda: busy_cache().core.stats()),
    (_types.KVCachePoolStats, lambda: busy_cache().stats()),
    (_types.KVCachePoolStats, lambda: atb_mem.KVCachePool(8, 4, device=None).stats()),
    (_types.MemPoolStats, lambda: mem_pool().stats()),
    (_types.LiveAllocation, lambda: mem_pool().snapshot()[0]),
    (_types.RequestBatcherConfig, lambda: batcher()._core.config()),
    (_types.RequestBatcherConfig,
     lambda: (core := batcher()._core).set_config(core.config())),
    (_types.ContinuousSchedulerConfig, lambda: scheduler().config),
    (_types.ContinuousSchedulerConfig, lambda: scheduler().reconfigure(max_num_seqs=4)),
    (_types.ContinuousSchedulerConfig,
     lambda: (core := scheduler()._core).set_config(core.config())),
    (_types.SchedulerCounts, lambda: scheduler()._core.counts()),
    (_types.ContinuousBatchSchedulerStats, lambda: scheduler().stats()),
    (_types.DynamicBatchSchedulerConfig, lambda: batcher().config),
    (_types.DynamicBatchSchedulerConfig, lambda: batcher().reconfigure(timeout_ms=10)),
    (_types.DynamicBatchSchedulerStats, lambda: batcher().stats()),
]


@pytest.mark.parametrize(("typed_dict", "produce"), RETURNED,
                         ids=[f"{case[0].__name__}-{i}" for i, case in enumerate(RETURNED)])
def test_typed_dicts_match_what_the_code_returns(typed_dict: Any,
                                                 produce: Callable[[], object]) -> None:
    assert_shape(typed_dict, produce())


# (class, method) of the stub -> the annotation of what it returns
STUB_RETURNS = {
    ("KVCachePool", "stats"): "KVCacheStats",
    ("MemPool", "stats"): "MemPoolStats",
    ("MemPool", "snapshot"): "list[LiveAllocation]",
    ("MemPool", "policy"): "AlignmentPolicy",
    ("KVCachePool", "dtype"): "KVDtype",
    ("RequestBatcher", "config"): "RequestBatcherConfig",
    ("RequestBatcher", "set_config"): "RequestBatcherConfig",
    ("ContinuousScheduler", "config"): "ContinuousSchedulerConfig",
    ("ContinuousScheduler", "set_config"): "ContinuousSchedulerConfig",
    ("ContinuousScheduler", "counts"): "SchedulerCounts",
}


@pytest.mark.parametrize(("owner", "method"), list(STUB_RETURNS))
def test_the_stub_names_the_typed_dicts(owner: str, method: str) -> None:
    node = next(n for n in stub_classes()[owner].body
                if isinstance(n, ast.FunctionDef) and n.name == method)
    assert node.returns is not None
    assert ast.unparse(node.returns) == STUB_RETURNS[owner, method]


@pytest.mark.parametrize(("function", "typed_dict"), [
    (atb_mem.KVCachePool.stats, _types.KVCachePoolStats),
    (atb_mem.ContinuousBatchScheduler.stats, _types.ContinuousBatchSchedulerStats),
    (atb_mem.ContinuousBatchScheduler.reconfigure, _types.ContinuousSchedulerConfig),
    (atb_mem.DynamicBatchScheduler.stats, _types.DynamicBatchSchedulerStats),
    (atb_mem.DynamicBatchScheduler.reconfigure, _types.DynamicBatchSchedulerConfig),
], ids=lambda value: getattr(value, "__qualname__", ""))
def test_the_python_classes_name_the_typed_dicts(function: Any, typed_dict: Any) -> None:
    assert get_type_hints(function)["return"] is typed_dict


def test_config_properties_name_the_typed_dicts() -> None:
    for owner, typed_dict in ((atb_mem.ContinuousBatchScheduler,
                               _types.ContinuousSchedulerConfig),
                              (atb_mem.DynamicBatchScheduler,
                               _types.DynamicBatchSchedulerConfig)):
        assert get_type_hints(owner.config.fget)["return"] is typed_dict


def test_dtypes_are_what_the_binding_accepts_and_names() -> None:
    names = get_args(_types.KVDtype)
    for name in (*names, *get_args(_types.KVDtypeAlias)):
        assert _core.KVCachePool(4, 4, dtype=name).dtype in names
    assert {_core.KVCachePool(4, 4, dtype=name).dtype for name in names} == set(names)
    with pytest.raises(ValueError, match="dtype"):
        _core.KVCachePool(4, 4, dtype="float8")


def test_policies_are_what_the_binding_accepts_and_names() -> None:
    for policy in get_args(_types.AlignmentPolicy):
        pool = atb_mem.MemPool(4096, policy=policy)
        assert pool.policy == policy and pool.stats()["policy"] == policy
    with pytest.raises(ValueError, match="unknown policy"):
        atb_mem.MemPool(4096, policy="cuda")


def test_preemption_modes_are_what_the_binding_accepts() -> None:
    kv = atb_mem.KVCachePool(8, 4, device=None, num_host_blocks=4)  # swap needs a host tier
    for mode in get_args(_types.Preemption):
        assert atb_mem.ContinuousBatchScheduler(kv, preemption=mode).config["preemption"] == mode
    with pytest.raises(ValueError, match="preemption"):
        atb_mem.ContinuousBatchScheduler(kv, preemption="evict")  # type: ignore[arg-type]


def test_timeout_actions_are_what_the_binding_accepts() -> None:
    for action in get_args(_types.TimeoutAction):
        batch = atb_mem.DynamicBatchScheduler(timeout_action=action)
        assert batch.config["timeout_action"] == action
        assert batch._core.config()["timeout_action"] == action
    with pytest.raises(ValueError, match="timeout_action"):
        atb_mem.DynamicBatchScheduler(timeout_action="drop")  # type: ignore[arg-type]


def test_backend_names() -> None:
    assert {NumpyBackend.name, TorchBackend.name} == set(get_args(_types.BackendName))


def test_backings_follow_the_protocol() -> None:
    members = {"ptr", "nbytes", "view"}
    for backing in (_core.HostRegion, atb_mem.memory.backends.TorchRegion):
        assert members <= set(dir(backing)), backing
