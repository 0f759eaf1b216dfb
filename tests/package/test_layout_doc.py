"""docs/layout.md names every tracked source file: under the deepest folder its table lists,
by name (a folder's ``mod.rs`` or ``__init__.py`` by the folder's); the test folders, whose
files are many, by their folder, each with a line of what it holds."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "layout.md"
SOURCE = re.compile(r"\.(rs|py|pyi|sh)$")
# Folders described as a whole (their files are tests, named for what they test).
WHOLE = ("tests", "rust/core/tests")
LEFT_BEHIND = {"__pycache__", "target", "site", "dist", "build"}


def rows() -> dict[str, str]:
    """The table's rows: a path (no trailing slash) to its description."""
    table: dict[str, str] = {}
    for line in LAYOUT.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|", 1)]
        if len(cells) == 2 and cells[0].startswith("`"):
            table[cells[0].strip("`").rstrip("/")] = cells[1]
    return table


def tracked() -> list[str]:
    """The repository's files: git's list, or in CI's copy of them (no ``.git``) the copy's
    files, less what running the tools leaves behind."""
    if (ROOT / ".git").exists():
        listing = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
    else:
        listing = [str(path.relative_to(ROOT)) for path in ROOT.rglob("*") if path.is_file()
                   and not any(part in LEFT_BEHIND or (part.startswith(".") and part != ".ci")
                               for part in path.relative_to(ROOT).parts)]
    return [path for path in listing if SOURCE.search(path) or path.startswith(".ci/")]


def unnamed(path: str, table: dict[str, str]) -> str | None:
    """Why ``path`` is not named (None: it is)."""
    pure = PurePosixPath(path)
    folders = [str(parent) for parent in pure.parents if str(parent) in table]
    if not folders:
        return "no row of the table lists a folder above it"
    row = folders[0]
    if row in WHOLE or any(folder in WHOLE for folder in folders):
        whole = next(folder for folder in folders if folder in WHOLE)
        inner = PurePosixPath(path).relative_to(whole).parent
        if str(inner) == "." or row != whole:
            return None
        return None if f"{inner.parts[0]}/" in table[whole] else \
            f"its folder {inner.parts[0]}/ is not named in the {whole}/ row"
    relative = pure.relative_to(row)
    name = relative.name
    if name in ("mod.rs", "__init__.py", "lib.rs", "main.rs") and relative.parent.parts:
        name = f"{relative.parent.parts[-1]}/"
    elif name in ("mod.rs", "__init__.py", "lib.rs"):
        return None  # the row's folder itself
    return None if name in table[row] else f"{name} is not in the {row} row"


def test_every_tracked_source_file_is_named() -> None:
    table = rows()
    missing = {path: why for path in tracked() if (why := unnamed(path, table)) is not None}
    assert not missing, "\n".join(f"{path}: {why}" for path, why in sorted(missing.items()))


def test_a_file_left_out_is_found() -> None:
    table = rows()
    assert unnamed("rust/core/src/attention/decode.rs", table) is None
    table["rust/core/src/attention"] = table["rust/core/src/attention"].replace("decode.rs", "")
    assert unnamed("rust/core/src/attention/decode.rs", table) is not None
    assert unnamed("nowhere/new.py", table) is not None
