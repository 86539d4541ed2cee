"""The console every printed table and line goes through (the CLI, the main job)."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

#: The width of a console that does not print to a terminal.
PIPE_WIDTH = 100_000


def text_console(**kwargs: Any) -> "Console":
    """The console every ``areal-fn`` table and line goes through: it prints text as is.

    Names, paths and allocation strings come from the user, so rich's markup
    (``megatron[actor]``, ``out[bold]``) and emoji codes (``a:cat:b``) are not
    interpreted; styling is explicit (``rich.text.Text``). Lines are not folded at the
    terminal width, so a printed path stays one line that can be copied. Printed to a
    file or a pipe (not a terminal; ``width`` not given), tables take their full width
    (:data:`PIPE_WIDTH` columns at most), so no name in a cell is folded or cut.
    """
    from rich.console import Console

    console = Console(markup=False, emoji=False, soft_wrap=True, **kwargs)
    if "width" not in kwargs and not console.is_terminal:
        console.width = PIPE_WIDTH
    return console
