"""docs/layout.md names every source file of the two crates and the Python package (by file
name; `mod.rs`, `lib.rs` and `__init__.py` are their folders' and need no entry)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "layout.md"
SOURCES = [
    (ROOT / "rust" / "core" / "src", "*.rs"),
    (ROOT / "rust" / "python" / "src", "*.rs"),
    (ROOT / "python" / "atb_mem", "*.py"),
]
EXEMPT = {"mod.rs", "lib.rs", "__init__.py"}


def source_files() -> list[Path]:
    return sorted(path for folder, pattern in SOURCES for path in folder.rglob(pattern)
                  if path.name not in EXEMPT)


def named(name: str, text: str) -> bool:
    """`name` appears as a whole file name (`state.rs` is not named by `sequence_state.rs`)."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", text) is not None


def test_sources_found() -> None:
    assert len(source_files()) > 50


def test_layout_names_every_source_file() -> None:
    text = LAYOUT.read_text()
    missing = [str(path.relative_to(ROOT)) for path in source_files()
               if not named(path.name, text)]
    assert not missing, "docs/layout.md does not name:\n" + "\n".join(missing)
