"""docs/layout.md names every source file of the two crates and the Python package, in the
row of its folder (the row whose path is the longest that holds it; `mod.rs`, `lib.rs` and
`__init__.py` are their folders' and need no entry)."""

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


def rows() -> dict[str, str]:
    """Each table row's folder and its text."""
    found = {}
    for line in LAYOUT.read_text().splitlines():
        match = re.match(r"\| `([^`]+)` \|(.*)", line)
        if match:
            found[match.group(1).rstrip("/")] = match.group(2)
    return found


def row_of(path: str, table: dict[str, str]) -> str:
    """The text of the row whose folder is the longest that holds `path`."""
    folders = [folder for folder in table if path.startswith(folder + "/")]
    return table[max(folders, key=len)] if folders else ""


def test_layout_names_every_source_file() -> None:
    table = rows()
    missing = []
    for path in source_files():
        relative = path.relative_to(ROOT).as_posix()
        if not named(path.name, row_of(relative, table)):
            missing.append(relative)
    assert not missing, "docs/layout.md's rows do not name:\n" + "\n".join(missing)
