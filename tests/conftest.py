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


# the collection guard (``--check-collection``): hooks defined in tests/collection_guard.py
import pytest  # noqa: E402

from tests.collection_guard import (  # noqa: E402
    pytest_addoption as pytest_addoption,
)
from tests.collection_guard import (  # noqa: E402
    pytest_runtest_logreport as pytest_runtest_logreport,
)
from tests.collection_guard import (  # noqa: E402
    pytest_sessionfinish as pytest_sessionfinish,
)
from tests.collection_guard import (  # noqa: E402
    pytest_terminal_summary as pytest_terminal_summary,
)


@pytest.fixture(autouse=True)
def _cli_errors_speak_in_flags(monkeypatch):
    """Every error line ``areal-fn`` prints, in any test, speaks in flags and the user's own
    paths (:func:`tests.cli_terms.cli_term_problems`)."""
    import areal_fn.cli as cli
    from tests.cli_terms import cli_term_problems

    printed: list[tuple[str, list[str]]] = []
    original = cli.error_line

    def recording(e, args, argv):
        line = original(e, args, argv)
        printed.append((line, list(argv)))
        return line

    monkeypatch.setattr(cli, "error_line", recording)
    yield
    wrong = [(line, argv, p) for line, argv in printed if (p := cli_term_problems(line, argv))]
    assert not wrong, f"CLI error lines in the library's terms: {wrong}"
