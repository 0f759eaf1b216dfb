from __future__ import annotations

import os

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI a skipped test is a failed run: nothing may pass by not running."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") and skipped and session.exitstatus == 0:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
