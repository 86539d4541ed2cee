"""The project's runtime type checker: beartype that leaves Python's ``random`` alone.

beartype checks a random item of each container argument, drawing from Python's
global ``random`` generator. A training loop that seeds ``random`` for data order
would then see its sequence shift whenever it calls a checked function. This wrapper
restores the generator's state after every outermost checked call (checked calls made
inside one are covered by it, so the state is saved once per call into the library),
so calling areal_fn never changes the caller's random stream (a law in
``tests/laws/test_purity.py``).
"""

import functools
import random as _random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from beartype import beartype as _beartype

F = TypeVar("F", bound=Callable[..., Any])

#: Per thread: how many checked calls are running (only the outermost saves the state).
_depth = threading.local()


def beartype(fn: F) -> F:
    """``beartype.beartype(fn)``, preserving the state of Python's ``random`` module."""
    checked = _beartype(fn)
    if checked is fn:  # nothing to check
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "n", 0)
        if depth:
            _depth.n = depth + 1
            try:
                return checked(*args, **kwargs)
            finally:
                _depth.n = depth
        state = _random.getstate()
        _depth.n = 1
        try:
            return checked(*args, **kwargs)
        finally:
            _depth.n = 0
            _random.setstate(state)

    return wrapper  # type: ignore[return-value]
