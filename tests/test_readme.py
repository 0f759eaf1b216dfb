"""The README's example is part of the test suite."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, "the README has exactly one Python example"
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "__readme__"})


def test_readme_names_the_commands() -> None:
    text = README.read_text()
    assert "pip install ." in text
    assert "python -m pytest" in text and "cargo test -p atb-mem-core" in text
