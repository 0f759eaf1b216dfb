"""``atb-mem generate``: a saved checkpoint (model and tokenizer made by the test), streamed
text equal to ``Engine.generate``'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from atb_mem.serving import Engine, SamplingParams
from atb_mem.tools.cli import main
from tests.support.models import save_tiny_checkpoint


def test_generate_streams_what_the_engine_generates(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_checkpoint(tmp_path)
    engine = Engine.from_pretrained(str(tmp_path), device="cpu", num_blocks=32)
    [expected] = engine.generate("the block table", SamplingParams(max_tokens=12,
                                                                   temperature=0))
    assert expected.outputs[0].text
    code = main(["generate", str(tmp_path), "--prompt", "the block table", "--max-tokens", "12",
                 "--device", "cpu", "--num-blocks", "32"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith(expected.outputs[0].text)
    assert f"finished: {expected.outputs[0].finish_reason}" in out


def test_generate_refuses_a_bad_model_dir(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
