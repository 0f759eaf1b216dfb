"""The devices the byte tests run on, and torch on demand."""

from __future__ import annotations

import os
from typing import Any

import pytest

# "host" is numpy; "cpu" and "cuda" are torch (the cuda tests run only with -m cuda).
DEVICES = ["host", "cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def require_torch() -> Any:
    """The torch module. Without torch the test is skipped, or fails when
    ATB_MEM_REQUIRE_TORCH is set (CI sets it: there, a test that needs torch must run)."""
    try:
        import torch
    except ImportError:
        if os.environ.get("ATB_MEM_REQUIRE_TORCH"):
            pytest.fail("torch is required here (ATB_MEM_REQUIRE_TORCH is set) but missing")
        pytest.skip("torch is not installed")
    return torch
