"""The tensor-parallel tests load the serving tests' tiny checkpoint (saved once per module)."""

from tests.serving.conftest import checkpoint

__all__ = ["checkpoint"]
