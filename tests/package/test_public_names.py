"""What ``import atb_mem`` offers, and what it does not import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import atb_mem

PUBLIC = ["NULL_BLOCK", "PAD_SLOT", "Allocation", "AtbMemError", "Batch", "BatchTable",
          "BlockMoveError", "ContinuousBatchScheduler", "DuplicateSequenceError",
          "DynamicBatchScheduler", "HostRegion", "InvalidHandleError", "KVCachePlan",
          "KVCachePool", "KVTensors", "MemPool", "OutOfMemoryError", "QueueFullError",
          "RequestRefusedError", "RequestTimeoutError", "StepPlan", "UnknownSequenceError",
          "__version__", "acl", "attention", "backends", "plan_kv_cache"]


def test_every_public_name_is_there() -> None:
    assert sorted(atb_mem.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(atb_mem, name) is not None, name


def test_modules_are_attributes_of_the_package() -> None:
    from atb_mem.kv import attention
    from atb_mem.memory import acl, backends
    from atb_mem.observability import metrics

    assert atb_mem.acl is acl and atb_mem.backends is backends
    assert atb_mem.attention is attention and atb_mem.metrics is metrics
    assert atb_mem.metrics.AtbMemCollector is metrics.AtbMemCollector
    pool = atb_mem.acl.aclrtMemPoolCreate({"maxSize": 1 << 16})
    atb_mem.acl.aclrtMemPoolDestroy(pool)
    assert {"acl", "attention", "backends", "metrics"} <= set(dir(atb_mem))


def test_unknown_attributes_still_raise() -> None:
    try:
        atb_mem.no_such_thing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as error:
        assert "no_such_thing" in str(error)
    else:
        raise AssertionError("atb_mem.no_such_thing did not raise AttributeError")


def test_import_leaves_tools_and_optional_parts_alone() -> None:
    """The command's dependencies, the optional metrics and torch load only when asked for."""
    child = textwrap.dedent("""
        import json, sys
        import atb_mem
        print(json.dumps(sorted(sys.modules)))
    """)
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                            timeout=120, check=True)
    loaded = set(json.loads(result.stdout))
    for module in ("atb_mem.tools", "atb_mem.observability", "atb_mem.memory.acl",
                   "atb_mem.kv.attention", "prometheus_client", "click", "rich", "torch"):
        assert module not in loaded, f"import atb_mem imported {module}"
