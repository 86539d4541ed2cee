"""The embedded model configs, and the one resolver of a model argument.

``specs/models/<name>.json`` of this checkout are real HF ``config.json`` files
(``Qwen2.5-7B``, ``Llama-3.1-8B``, ...; an installed wheel does not carry them, so there
only ``demo`` is listed) and ``demo`` is the tiny model of ``areal-fn demo``.
:func:`resolve_config` is what :func:`~areal_fn.model.spec.load_hf_config` (so
:func:`~areal_fn.model.spec.model_from_hf_config`) and every ``areal-fn`` command use:
a path that exists wins; otherwise the argument names an embedded config, matched
without regard to case and with an HF organisation prefix allowed
(``qwen2.5-7b``, ``Qwen/Qwen2.5-7B``); anything else is refused with the close matches.
"""

import difflib
from collections.abc import Sequence
from pathlib import Path

from areal_fn.errors import SpecError
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.typecheck import beartype

__all__ = ["DEMO", "embedded_names", "match_name", "resolve_config"]

#: The name of the tiny demo model.
DEMO = "demo"


def _folder() -> Path:
    return Path(__file__).parents[2] / "specs" / "models"


@beartype
def embedded_names() -> tuple[str, ...]:
    """The embedded config names, ``demo`` first, then the files sorted by name."""
    folder = _folder()
    files = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
    return (DEMO, *files)


@beartype
def match_name(text: str, names: Sequence[str]) -> str | None:
    """The name in ``names`` that ``text`` spells (case-insensitive; an HF organisation
    prefix ``Org/`` is dropped), or None."""
    key = text.strip()
    if key.count("/") == 1:
        key = key.split("/")[1]
    by_key = {n.lower(): n for n in names}
    return by_key.get(key.lower())


def _unknown(text: str, names: Sequence[str]) -> str:
    lowered = {n.lower(): n for n in names}
    key = text.split("/")[-1].lower()
    close = [lowered[k] for k in difflib.get_close_matches(key, list(lowered), n=3, cutoff=0.6)]
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    listed = "" if close else f" ({', '.join(names)})"
    return (
        f"no config file at {text!r} and no embedded model of that name; {hint}pass a "
        f"config.json, a directory holding one, or a name that `areal-fn models` lists{listed}"
    )


@beartype
def resolve_config(path: str) -> Path | dict[str, object]:
    """The ``config.json`` file that ``path`` means, or the demo config itself.

    An existing file is itself, an existing directory its ``config.json``; a name that
    :func:`match_name` finds among :func:`embedded_names` is that embedded config.
    ``SpecError`` otherwise, with the close matches and the names to choose from.
    """
    given = Path(path)
    p = given / "config.json" if given.is_dir() else given
    if p.is_file():
        return p
    if given.exists():
        raise SpecError(
            f"no config file at {str(p)!r}; pass a config.json path, a directory holding "
            f"config.json, or the config as a dict"
        )
    names = embedded_names()
    name = match_name(str(path), names)
    if name == DEMO:
        return dict(DEMO_CONFIG)
    if name is not None:
        return _folder() / f"{name}.json"
    raise SpecError(_unknown(str(path), names))
