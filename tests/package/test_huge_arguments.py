"""One huge size argument raises (ValueError or MemoryError); it never aborts the interpreter.

A constructor whose bookkeeping is proportional to a size argument either refuses the size up
front (ValueError naming the argument and the bytes it implies) or, when the host is short of
memory, raises OutOfMemoryError (a MemoryError) instead of letting a failed Rust allocation
abort the process. Each case runs in a child interpreter whose address space is capped a
little above what it already uses, so the allocation fails deterministically on any machine,
and an abort (SIGABRT) fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import atb_mem

# Runs one constructor call under an address-space cap of (current size + HEADROOM_MIB) and
# reports what it raised as one JSON line; exits 0 only when it raised ValueError/MemoryError.
CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import atb_mem

    call, headroom_mib = sys.argv[1], int(sys.argv[2])
    with open("/proc/self/status") as status:
        vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm_kib * 1024 + headroom_mib * 2**20
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        eval(call, {"atb_mem": atb_mem})
    except (ValueError, MemoryError) as error:
        print(json.dumps({"type": type(error).__name__, "message": str(error),
                          "memory_error": isinstance(error, MemoryError),
                          "out_of_memory": isinstance(error, atb_mem.OutOfMemoryError)}))
        sys.exit(0)
    print(json.dumps({"type": None}))
    sys.exit(3)
    """
)

HEADROOM_MIB = 256

# (call, the argument the message must name). Each would take far more than HEADROOM_MIB of
# host memory if it were accepted.
CASES = [
    ("atb_mem.KVCachePool(num_blocks=2, block_size=16, device=None)"
     ".batch_table(max_seqs=2**28, max_blocks_per_seq=1)", "max_seqs"),
    ("atb_mem.KVCachePool(num_blocks=2, block_size=16, device=None)"
     ".batch_table(max_seqs=2**24, max_blocks_per_seq=16)", "max_seqs"),
    ("atb_mem.MemPool(4096, max_allocations=2**26)", "max_allocations"),
    ("atb_mem.MemPool(4096, backing=None, max_allocations=2**25)", "max_allocations"),
    ("atb_mem.KVCachePool(num_blocks=2**27, block_size=1, device=None)", "num_blocks"),
    ("atb_mem.KVCachePool(num_blocks=2**26, block_size=1, device=None, "
     "enable_prefix_caching=False)", "num_blocks"),
    ("atb_mem.KVCachePool(num_blocks=16, block_size=1, device=None, num_host_blocks=2**27 - 1)",
     "num_host_blocks"),
    ("atb_mem.MemPool(2**46)", "capacity"),
    ("atb_mem._core.HostRegion(2**46)", "nbytes"),
]


def run_child(call: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", CHILD, call, str(HEADROOM_MIB)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and RLIMIT_AS")
@pytest.mark.parametrize(("call", "argument"), CASES, ids=[case[0] for case in CASES])
def test_huge_argument_raises_in_a_short_of_memory_process(call: str, argument: str) -> None:
    child = run_child(call)
    assert child.returncode == 0, (
        f"child exited with {child.returncode} (negative: killed by that signal; -6 is an "
        f"abort)\nstdout: {child.stdout}\nstderr: {child.stderr[-2000:]}"
    )
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert argument in report["message"], report
    if report["memory_error"]:
        # Short of memory: the library's own class, which names the bytes it wanted.
        assert report["out_of_memory"], report
        assert "bytes" in report["message"], report
    else:
        assert report["type"] == "ValueError", report


# Sizes refused before anything is allocated: safe to try in this process.
REFUSED = [
    (lambda: atb_mem.KVCachePool(2, 16, device=None).batch_table(2**28, 1), "max_seqs"),
    (lambda: atb_mem.KVCachePool(2, 16, device=None).batch_table(2**40, 1), "max_seqs"),
    (lambda: atb_mem.KVCachePool(2, 16, device=None).batch_table(2**62, 2**62), "too large"),
    (lambda: atb_mem.KVCachePool(2**27 + 1, 1, device=None), "num_blocks"),
    (lambda: atb_mem.KVCachePool(2**62, 1, device=None), "num_blocks"),
    (lambda: atb_mem.KVCachePool(2**63 - 1, 1, device=None), "num_blocks"),
    (lambda: atb_mem.KVCachePool(16, 1, device=None, num_host_blocks=2**63 - 2),
     "num_host_blocks"),
    (lambda: atb_mem.MemPool(4096, max_allocations=2**26 + 1), "max_allocations"),
    (lambda: atb_mem.MemPool(4096, max_allocations=2**32 - 1), "max_allocations"),
]


@pytest.mark.parametrize(("call", "argument"), REFUSED, ids=range(len(REFUSED)))
def test_huge_argument_is_refused_with_a_clear_message(call, argument: str) -> None:
    with pytest.raises((ValueError, MemoryError)) as info:
        call()
    assert argument in str(info.value)


def test_refusal_names_the_bytes() -> None:
    with pytest.raises(ValueError, match=r"max_seqs = 268435456.* bytes"):
        atb_mem.KVCachePool(2, 16, device=None).batch_table(2**28, 1)
    with pytest.raises(ValueError, match=r"num_blocks = 4611686018427387904.*bytes"):
        atb_mem.KVCachePool(2**62, 1, device=None)


COUNTS = ["hash_block_size", "state_checkpoint_interval", "num_host_blocks", "sliding_window",
          "attention_chunk_size", "num_layers", "num_kv_heads", "head_dim", "state_bytes"]


@pytest.mark.parametrize("argument", COUNTS)
@pytest.mark.parametrize("value", [0, -1, 2**64])
def test_a_bad_count_names_its_argument(argument: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"^{argument}"):
        atb_mem.KVCachePool(16, 4, device=None, **{argument: value})


@pytest.mark.parametrize("value", [0, -1, 2**64])
def test_a_bad_size_names_its_argument_and_unit(value: int) -> None:
    with pytest.raises(ValueError, match=r"^block_size \(tokens\)"):
        atb_mem.KVCachePool(16, value, device=None)
    with pytest.raises(ValueError, match=r"^num_blocks \(blocks"):
        atb_mem.KVCachePool(value, 4, device=None)
