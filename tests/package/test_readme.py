"""The README's example and the serving page's are part of the test suite; the README's is the
quickstart script verbatim, and the README stays a README (the reference is in docs/)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.models import require_transformers

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SERVING = ROOT / "docs" / "serving.md"
QUICKSTART = ROOT / "examples" / "quickstart.py"


def python_blocks(path: Path) -> list[str]:
    blocks: list[str] = re.findall(r"^```python\n(.*?)^```$", path.read_text(),
                                   flags=re.S | re.M)
    return blocks


def readme_examples() -> list[str]:
    """The quickstart (README), then serving, hybrid models, recurrent states and KV-cache
    events (docs)."""
    readme, serving = python_blocks(README), python_blocks(SERVING)
    assert len(readme) == 1 and len(serving) == 4, (len(readme), len(serving))
    return readme + serving


def readme_example() -> str:
    return readme_examples()[0]


@pytest.mark.parametrize("index", [0, 1, 2, 3, 4])
def test_readme_example_runs(index: int) -> None:
    if index == 1:
        require_transformers()
    source = README if index == 0 else SERVING
    exec(compile(readme_examples()[index], str(source), "exec"), {"__name__": "__readme__"})


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024
    links = re.findall(r"\]\((docs/[^)#]+)\)", text)
    assert links and all((ROOT / link).is_file() for link in links), links


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
