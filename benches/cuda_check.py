"""The CUDA checks and timings of the KV-tensor issue, as one command for a CUDA machine:

    python benches/cuda_check.py

Runs every test and benchmark marked ``cuda`` (KV views, write_kv, copy-on-write, swap to
pinned host memory and back, paged attention against torch's SDPA, on ``cuda:0``; the engine
against HF ``generate`` on CUDA, and on FlashInfer's kernel where ``flashinfer-python`` is
installed), then prints the write_kv and swap rates against a contiguous device copy measured
in the same run.
Exits non-zero if CUDA is missing or anything fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("CUDA is not available on this machine", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q",
               "-s", "--benchmark-enable", "tests/kv", "tests/integrations", "tests/serving",
               "benches/test_bench_kv_tensors.py"]
    return subprocess.call(command, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
