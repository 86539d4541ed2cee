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
