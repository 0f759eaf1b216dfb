"""The device-utilisation gauge: exported as a ratio where the device reports it, left out
(not a made-up 0) where it cannot be read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

GAUGE = "atb_mem_device_utilization_ratio"


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Any:
    from atb_mem.serving import Engine

    return Engine.from_pretrained(str(checkpoint), device="cpu", num_blocks=16, block_size=4)


def rendered(engine: Any, **kwargs: Any) -> str:
    from atb_mem.serving.server_metrics import ServerMetrics

    return ServerMetrics(engine, "tiny", **kwargs).render().decode()


def test_a_reported_utilisation_is_exported_as_a_ratio(engine: Any) -> None:
    readings = iter([75.0, 40.0])
    from atb_mem.serving.server_metrics import ServerMetrics

    metrics = ServerMetrics(engine, "tiny", device_utilization=lambda: next(readings))
    assert f'{GAUGE}{{model_name="tiny"}} 0.75' in metrics.render().decode()
    assert f'{GAUGE}{{model_name="tiny"}} 0.4' in metrics.render().decode()


def test_a_failed_read_leaves_the_gauge_out_and_the_rest_in(engine: Any) -> None:
    def broken() -> float:
        raise RuntimeError("pynvml is not installed")

    text = rendered(engine, device_utilization=broken)
    assert GAUGE not in text and "atb_mem_kv_cache_blocks" in text


def test_the_cpu_reports_no_utilisation(engine: Any) -> None:
    from atb_mem.serving.server_metrics import device_utilization_reader

    assert device_utilization_reader("cpu") is None
    assert GAUGE not in rendered(engine)


def test_a_cuda_reader_reads_torchs_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from atb_mem.serving.server_metrics import device_utilization_reader

    asked: list[Any] = []
    monkeypatch.setattr(torch.cuda, "utilization",
                        lambda index=None: asked.append(index) or 63)
    read = device_utilization_reader("cuda:1")
    assert read is not None and read() == 63.0 and asked == [1, 1]

    def refuses(index: Any = None) -> int:
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "utilization", refuses)
    assert device_utilization_reader("cuda") is None
