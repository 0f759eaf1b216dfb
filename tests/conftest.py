from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI a skipped test is a failed run: nothing may pass by not running."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") and skipped and session.exitstatus == 0:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True, scope="session")
def _engines_run_eager() -> Iterator[None]:
    """An Engine on the CPU compiles its forward at start-up (torch.compile, seconds to a
    minute per model on two cores). The suite's hundreds of engines run eager under torch's
    own switch (``TORCH_COMPILE_DISABLE``'s); the ``compiled`` fixture turns compiling back on
    for the tests of the compiled path (tests/integrations/test_compiled_forward.py)."""
    try:
        import torch._dynamo
    except ImportError:  # the core's tests run without torch
        yield
        return
    before = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = before


@pytest.fixture
def compiled() -> Iterator[None]:
    """torch.compile on for this test (off for the rest of the suite)."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=False):
        yield
