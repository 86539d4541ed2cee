"""How a :class:`~areal_fn.errors.ParseError` shows an allocation string.

The input is shown escaped (tabs, newlines, non-ASCII as ``\\t``, ``\\x..``,
``\\u....``), windowed to :data:`_WINDOW` characters on either side of the offending
position, with a caret under it (wide and combining characters counted by their
display width); a character is named by its repr, or by its code point and Unicode
name when it is not printable ASCII.
"""

import unicodedata

#: Whitespace stripped at both ends and allowed around '+' and '|'.
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
