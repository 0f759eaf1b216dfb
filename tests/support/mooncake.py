"""A real ``mooncake_master`` on 127.0.0.1 for the shared-store tests: started on free ports,
waited for (bounded), stopped — or killed, by a fault test. Without Mooncake installed the
tests skip, except in CI (``ATB_MEM_REQUIRE_TORCH``), where ``.ci/run`` installs it and a
missing one fails."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import free_port


def require_mooncake() -> str:
    """The ``mooncake_master`` program (skipped without it, failed in CI)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        if os.environ.get("ATB_MEM_REQUIRE_TORCH"):
            pytest.fail(f"Mooncake is required here (ATB_MEM_REQUIRE_TORCH is set): {error}")
        pytest.skip(f"Mooncake is not installed: {error}")
    master = shutil.which("mooncake_master") or str(Path(sys.executable).parent /
                                                    "mooncake_master")
    if not Path(master).exists():
        pytest.fail("the Mooncake wheel is installed without its mooncake_master")
    return master


@dataclass
class Master:
    process: subprocess.Popen[bytes]
    url: str
    rpc_port: int

    def kill(self) -> None:
        """kill -9, as a crash would (the real program is a child of the console script)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def mooncake_master() -> Iterator[Master]:
    program = require_mooncake()
    rpc, metadata, metrics = free_port(), free_port(), free_port()
    process = subprocess.Popen(
        [program, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={metadata}", "--metrics_host=127.0.0.1",
         f"--metrics_port={metrics}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (_listening(rpc) and _listening(metadata)):
            assert process.poll() is None, "mooncake_master exited at start-up"
            assert time.monotonic() < deadline, "mooncake_master never listened"
            time.sleep(0.1)
        url = f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{metadata}/metadata" \
              "&segment=64MiB&buffer=16MiB"
        yield Master(process, url, rpc)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)
