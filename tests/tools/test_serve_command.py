"""``atb-mem serve`` as a user runs it: a process that answers, then stops cleanly on Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.models import save_tiny_checkpoint


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_serve_answers_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    import httpx

    save_tiny_checkpoint(tmp_path)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "atb_mem", "serve", str(tmp_path), "--port", str(port),
         "--device", "cpu", "--num-blocks", "64", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the server never answered /health"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)  # still loading the model
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                              timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] >= 1
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err
    assert f"serving 'tiny' on http://127.0.0.1:{port}" in out
    assert out.rstrip().endswith("atb-mem: stopped")
