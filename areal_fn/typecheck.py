"""The project's runtime type checker: beartype that leaves Python's ``random`` alone.

beartype checks a random item of each container argument, drawing from Python's
global ``random`` generator. A training loop that seeds ``random`` for data order
would then see its sequence shift whenever it calls a checked function. This wrapper
restores the generator's state after every checked call, so calling areal_fn never
changes the caller's random stream (a law in ``tests/laws/test_purity.py``).
"""

import functools
import random as _random
from collections.abc import Callable
from typing import Any, TypeVar

from beartype import beartype as _beartype

F = TypeVar("F", bound=Callable[..., Any])


def beartype(fn: F) -> F:
    """``beartype.beartype(fn)``, preserving the state of Python's ``random`` module."""
    checked = _beartype(fn)
    if checked is fn:  # nothing to check
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = _random.getstate()
        try:
            return checked(*args, **kwargs)
        finally:
            _random.setstate(state)

    return wrapper  # type: ignore[return-value]
