"""Output helpers of the ``areal-fn`` commands: JSON documents, sizes in and out."""

import json
import math
import sys
from fractions import Fraction
from typing import Any

from areal_fn.errors import SpecError

__all__ = ["UNITS", "emit_json", "human", "parse_size"]

#: Size units ``--device-memory`` reads (any case): decimal (GB = 10^9 bytes) and
#: binary (GiB = 2^30 bytes), exactly.
UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def emit_json(doc: dict[str, Any]) -> None:
    """Print ``doc`` as one JSON document (keys in the order built, two-space indent)."""
    sys.stdout.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")


def human(n: float) -> str:
    """``7.1 GiB``: bytes in binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def parse_size(text: str, *, flag: str = "--device-memory") -> int:
    """Bytes of ``80GB`` (80 * 10^9) or ``80GiB`` (80 * 2^30), read exactly (a fraction
    of a byte is dropped); a number without a unit, or ``80G``, is refused."""
    t = text.strip().replace(" ", "")
    digits = t.rstrip("KMGTBIkmgtbi")
    unit = t[len(digits) :].upper()
    example = "write e.g. 80GB (80*10^9 bytes) or 80GiB (80*2^30 bytes)"
    try:
        value = Fraction(digits)
    except (ValueError, ZeroDivisionError):
        raise SpecError(f"{flag} {text!r} is not a size; {example}") from None
    if not unit:
        raise SpecError(f"{flag} {text!r} has no unit; {example}")
    if unit not in UNITS:
        raise SpecError(
            f"{flag} {text!r}: unit {t[len(digits) :]!r} is not one of B, KB, MB, GB, TB "
            f"(powers of 10) or KiB, MiB, GiB, TiB (powers of 2); {example}"
        )
    nbytes = math.floor(value * UNITS[unit])
    if nbytes < 1:
        raise SpecError(f"{flag} {text!r} is not a positive size; {example}")
    return nbytes
