"""Shared pytest set-up: hypothesis profiles (ci, dev, nightly) and the collection guard."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("nightly", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# -- the collection guard (see tests/collection_guard.py) --------------------------------
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.collection_guard import defined_tests, missing_tests, summary_lines  # noqa: E402

_TESTS = Path(__file__).resolve().parent
_REPORTED: set[str] = set()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--check-collection",
        action="store_true",
        default=False,
        help="fail the run unless every test function defined under tests/ was reported",
    )


def _guarding(config: pytest.Config) -> bool:
    # only the controlling process judges (xdist workers see a share of the tests)
    return bool(config.getoption("--check-collection")) and not os.environ.get(
        "PYTEST_XDIST_WORKER"
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _REPORTED.add(report.nodeid)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    if not _guarding(config):
        return
    defined = defined_tests(_TESTS)
    terminalreporter.section("collection guard")
    for line in summary_lines(defined, _REPORTED):
        terminalreporter.write_line(line)
    missing = missing_tests(defined, _REPORTED)
    for folder, names in missing.items():
        terminalreporter.write_line(
            f"NOT RUN in {folder}: {len(names)} test functions, e.g. {names[:3]}", red=True
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _guarding(session.config):
        return
    if missing_tests(defined_tests(_TESTS), _REPORTED) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
