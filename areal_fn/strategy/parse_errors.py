"""How a :class:`~areal_fn.errors.ParseError` shows an allocation string.

The input is shown escaped (tabs, newlines, non-ASCII as ``\\t``, ``\\x..``,
``\\u....``), windowed to :data:`_WINDOW` characters on either side of the offending
position, with a caret under it (wide and combining characters counted by their
display width); a character is named by its repr, or by its code point and Unicode
name when it is not printable ASCII. The tables of which dimensions each place takes,
and the refusal of a dimension a place does not take, live here too.
"""

import re
import unicodedata

from areal_fn.strategy.allocation import Backend

#: Whitespace: allowed between any two tokens, never inside a word or a number.
_WS = " \t\r\n"
#: Characters shown on either side of the caret in a message.
_WINDOW = 60


def _show(ch: str) -> str:
    if ch == "\t":
        return "\\t"
    if ch == "\n":
        return "\\n"
    if ch == "\r":
        return "\\r"
    if ch.isprintable():
        return ch
    code = ord(ch)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def _width(shown: str) -> int:
    if len(shown) != 1:
        return len(shown)
    if unicodedata.combining(shown):
        return 0
    return 2 if unicodedata.east_asian_width(shown) in "WF" else 1


def _pointer(text: str, pos: int) -> str:
    """Two lines: the input (escaped, windowed if long) and a caret under ``pos``."""
    lo = max(0, pos - _WINDOW)
    hi = min(len(text), pos + _WINDOW)
    head = "..." if lo > 0 else ""
    tail = "..." if hi < len(text) else ""
    shown = [_show(ch) for ch in text[lo:hi]]
    column = len(head) + sum(_width(s) for s in shown[: pos - lo])
    return f"    {head}{''.join(shown)}{tail}\n    {' ' * column}^"


def _char(ch: str) -> str:
    if ch in _WS:
        return f"whitespace {ch!r}"
    if " " <= ch <= "~":
        return repr(ch)
    name = unicodedata.name(ch, "")
    return f"'{_show(ch)}' (U+{ord(ch):04X}{' ' + name if name else ''})"


def _short(word: str) -> str:
    return word if len(word) <= 24 else word[:20] + "..."


_DIM_NAMES = {
    "d": "data parallel",
    "p": "pipeline parallel",
    "t": "tensor parallel",
    "c": "context parallel",
    "e": "expert parallel",
    "v": "virtual pipeline stages",
}

_BACKEND_LIST = "sglang, vllm, fsdp, megatron"
_BACKENDS = frozenset(b.value for b in Backend)
_BARE_DIMS = re.compile(r"[dptcev][dptcev0-9]*")
_WELL_FORMED_DIMS = re.compile(r"(?:[dptcev][1-9][0-9]*)+")

# (section, backend) -> (dims taken with any value, dims taken only as 1).
_SECTION_DIMS: dict[tuple[str, Backend], tuple[str, str]] = {
    ("plain", Backend.SGLANG): ("dpt", ""),
    ("plain", Backend.VLLM): ("dpt", ""),
    ("plain", Backend.FSDP): ("dtc", "pe"),
    ("plain", Backend.MEGATRON): ("dptcev", ""),
    ("attn", Backend.MEGATRON): ("dptcv", ""),
    ("ffn", Backend.MEGATRON): ("dpte", ""),
}


def _where(backend: Backend, section: str) -> str:
    return backend.value if section == "plain" else f"the {section} section"


def _takes(backend: Backend, section: str) -> str:
    taken, unit_only = _SECTION_DIMS[(section, backend)]
    text = ", ".join(taken)
    if unit_only:
        text += f" ({' and '.join(unit_only)} only as 1)"
    return text


def _refusal(backend: Backend, section: str, letter: str) -> str:
    name = _DIM_NAMES.get(letter)
    takes = f"{_where(backend, section)} takes {_takes(backend, section)}"
    if name is None:
        hint = "; dimensions are lower case" if letter.lower() in _DIM_NAMES else ""
        return f"unknown dimension {letter!r}; {takes}{hint}"
    if section == "attn":
        return f"{letter} ({name}) belongs in the ffn section; {takes}"
    if section == "ffn":
        return f"{letter} ({name}) belongs in the attn section; {takes}"
    if backend.is_inference:
        return f"{backend.value} does not take {letter} ({name}); {takes}"
    return f"{backend.value} does not take {letter} ({name}); {takes}; use megatron with p >= 2 for virtual pipeline stages"


def _not_a_backend(word: str, ch: str) -> str:
    """Why a component cannot start with ``word`` (not a backend); ``ch`` comes next."""
    if _BARE_DIMS.fullmatch(word) and ch not in (":", "["):
        example = f"megatron:{word}" if _WELL_FORMED_DIMS.fullmatch(word) else "fsdp:d4"
        return (
            f"missing backend: {_short(word)!r} has no backend; start every component "
            f"with one of {_BACKEND_LIST}, e.g. {example!r}"
        )
    if word.lower() in _BACKENDS:
        return f"unknown backend {_short(word)!r}; backends are lower case: write {word.lower()!r}"
    if word == "archon":
        return f"backend 'archon' is not supported; expected one of {_BACKEND_LIST}"
    return f"unknown backend {_short(word)!r}; expected one of {_BACKEND_LIST}"
