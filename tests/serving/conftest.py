"""What the server tests share: a tiny model and tokenizer saved once per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import require_transformers, save_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_transformers()
    path = tmp_path_factory.mktemp("checkpoint")
    save_tiny_checkpoint(path)
    return path
