"""Servers run as a user runs them: a free local port, and a wait until ``/health`` answers."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_until_healthy(process: subprocess.Popen[str], port: int, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the server never answered /health"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)  # still loading the model
