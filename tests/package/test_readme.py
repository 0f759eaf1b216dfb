"""The README's example is part of the test suite, and is the quickstart script verbatim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.models import require_transformers

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
QUICKSTART = ROOT / "examples" / "quickstart.py"


def readme_examples() -> list[str]:
    blocks: list[str] = re.findall(r"^```python\n(.*?)^```$", README.read_text(),
                                   flags=re.S | re.M)
    assert len(blocks) == 4, \
        "the README's Python examples: the quickstart, serving, hybrid models, KV-cache events"
    return blocks


def readme_example() -> str:
    return readme_examples()[0]


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_readme_example_runs(index: int) -> None:
    if index == 1:
        require_transformers()
    exec(compile(readme_examples()[index], str(README), "exec"), {"__name__": "__readme__"})


def test_quickstart_is_the_readme_example() -> None:
    assert readme_example() in QUICKSTART.read_text()
    result = subprocess.run([sys.executable, str(QUICKSTART)], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "[68 67]" in result.stdout


def test_readme_names_the_commands() -> None:
    text = README.read_text()
    assert "pip install . && python examples/quickstart.py" in text
    assert "pip install . && atb-mem bench fragmentation" in text
    assert "python -m pytest" in text and "cargo test -p atb-mem-core" in text


def test_readme_fragmentation_table_is_what_the_command_prints(tmp_path: Path) -> None:
    import json

    text = README.read_text()
    first_command = re.search(r"^```sh\n(.*?)\n```", text, flags=re.S | re.M).group(1)
    assert first_command == "pip install . && atb-mem bench fragmentation --memory 2GiB"
    out = tmp_path / "fragmentation.json"
    # `python -m atb_mem` is what the atb-mem console script runs.
    subprocess.run([sys.executable, "-m", "atb_mem", "bench", "fragmentation", "--memory",
                    "2GiB", "--json", str(out)], check=True, capture_output=True, timeout=300)
    for result in json.loads(out.read_text())["results"]:
        block = str(result["block_size"] or "-")
        row = (rf"│ {result['strategy']}\s+│\s+{re.escape(block)} │\s+"
               rf"{result['internal_fragmentation']:.3f} │.*│\s+{result['peak_concurrency']} │")
        assert re.search(row, text), f"README row for {result['strategy']} {block}"
