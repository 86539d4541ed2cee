"""A published multimodal checkpoint read as its text model.

A checkpoint whose ``config.json`` has a ``model_type`` of
:data:`~areal_fn.model.families.TEXT_CONFIG_TYPES` (Qwen3.5's ``qwen3_5``,
``qwen3_5_moe``) is read as the text model its ``text_config`` describes
(:func:`~areal_fn.model.spec.model_from_hf_config` gives that model's spec): each stored
name under a renamed prefix (``model.language_model.layers.0...``) is read as its
canonical name (``model.layers.0...``), the others as they are stored (``lm_head.weight``).
The tensors of the parts that are not the text model (the family record's ``others``:
the vision encoder, the multi-token-prediction layers) are never dropped silently: the
readers refuse them, listed, unless ``text_only=True`` asks to leave them out
(:meth:`TextView.left_out`), and the conversion summaries list them as not carried.
"""

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from areal_fn.errors import ConversionError
from areal_fn.model.families import TEXT_CONFIG_TYPES, TextConfigType
from areal_fn.plans.tensor_check import listing

__all__ = ["TextView", "text_view"]

_OPTION = "text_only=True (HfCheckpoint.check, load_into, convert_to_local, convert_to_torch_dist)"


class TextView:
    """The names of a checkpoint's stored tensors as the text model reads them.

    ``kind`` is the multimodal record the checkpoint's ``config.json`` names (None for
    any other checkpoint: every name is read as stored). :meth:`name` and :meth:`stored`
    map a stored name to its canonical one and back; :attr:`others` are the stored names
    of the parts that are not the text model.
    """

    def __init__(self, path: Path, kind: TextConfigType | None, stored: Iterable[str]) -> None:
        self.path = path
        self.kind = kind
        self._canonical: dict[str, str] = {}
        self._stored: dict[str, str] = {}
        self.others: tuple[str, ...] = ()
        if kind is not None:
            self._rename(kind, tuple(stored))

    def _rename(self, kind: TextConfigType, names: tuple[str, ...]) -> None:
        held = set(names)
        others: list[str] = []
        for n in names:
            if any(n.startswith(p.prefix) for p in kind.others):
                others.append(n)
                continue
            c = _renamed(n, kind)
            if c != n:
                if c in held:
                    raise ConversionError(
                        f"{self.path} holds both {n!r} and {c!r}, the same tensor of the text "
                        f"model (a {kind.model_type} checkpoint stores it under the first "
                        "name); the checkpoint is inconsistent: save it again with one of them"
                    )
                self._canonical[n], self._stored[c] = c, n
        self.others = tuple(others)

    def name(self, stored: str) -> str:
        """The name ``stored`` is read as (a renamed prefix replaced)."""
        return self._canonical.get(stored, stored)

    def stored(self, name: str) -> str:
        """The stored name of the tensor read as ``name``."""
        return self._stored.get(name, name)

    def left_out(
        self, *, text_only: bool, drop_mtp: bool = False, remedy: str | None = None
    ) -> tuple[str, ...]:
        """The stored names left out: :attr:`others` with ``text_only=True``.

        ``ConversionError`` listing them, with the remedy (``remedy``, else passing
        ``text_only=True``), when there are some and ``text_only`` is False; for ``text_only=True`` on a checkpoint that is not read as
        a multimodal model's text model; and for ``drop_mtp=True`` on one that is (its
        multi-token-prediction layers are one of its other parts)."""
        mtp = [p.prefix for p in self.kind.others if p.mtp] if self.kind else []
        if drop_mtp and mtp:
            assert self.kind is not None
            raise ConversionError(
                f"drop_mtp=True: {self.path} is a {self.kind.model_type} checkpoint, read as "
                f"its text model, whose multi-token-prediction layers ({', '.join(mtp)}*) are "
                "not decoder layers but a part that is not the text model: pass "
                f"{_OPTION} to leave them out, and drop drop_mtp=True"
            )
        if not text_only:
            if self.others:
                default = f"pass {_OPTION} to leave them out (listed as not carried)"
                raise self._refusal(remedy or default)
            return ()
        if self.kind is None:
            types = ", ".join(t.model_type for t in TEXT_CONFIG_TYPES)
            raise ConversionError(
                f"text_only=True: {self.path} is not a multimodal checkpoint read as its text "
                f"model (its config.json's model_type is not one of {types}), so there is "
                "nothing to leave out; drop text_only=True"
            )
        return self.others

    def described(self, names: Sequence[str]) -> tuple[str, ...]:
        """One line per part that ``names`` (left out) hold: its prefix, what it is, how
        many tensors."""
        if self.kind is None:
            return ()
        out = []
        for p in self.kind.others:
            n = sum(1 for x in names if x.startswith(p.prefix))
            if n:
                out.append(
                    f"{p.prefix}* ({p.what}, {n} tensor{'s' if n > 1 else ''}: not the text "
                    "model, left out as asked)"
                )
        return tuple(out)

    def _refusal(self, remedy: str) -> ConversionError:
        assert self.kind is not None
        k = self.kind
        parts = ", ".join(
            f"{p.what} ({p.prefix}*: {n})"
            for p in k.others
            if (n := sum(1 for x in self.others if x.startswith(p.prefix)))
        )
        renamed = ", ".join(f"{a}* as {b}*" for a, b in k.renamed)
        return ConversionError(
            f"{self.path} is a {k.model_type} checkpoint (its config.json's model_type), read "
            f"as its text model {k.text_model_type} ({renamed}), and it holds "
            f"{len(self.others)} tensors that are not the text model: {parts}: "
            f"{listing(self.others)}; the model read has no place for them: {remedy}"
        )


def _renamed(name: str, kind: TextConfigType) -> str:
    for old, new in kind.renamed:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def text_view(path: Path, stored: Iterable[str]) -> TextView:
    """The :class:`TextView` of the checkpoint in ``path`` holding ``stored``, from the
    ``model_type`` of its ``config.json`` (none, or one that is no JSON object: every
    name read as stored; one that is not JSON: ``ConversionError``)."""
    f = path / "config.json"
    kind = None
    if f.is_file():
        try:
            config = json.loads(f.read_text())
        except ValueError as e:
            raise ConversionError(f"{f} is not JSON ({e})") from None
        if isinstance(config, dict):
            mt = config.get("model_type")
            kind = next((t for t in TEXT_CONFIG_TYPES if t.model_type == mt), None)
    return TextView(path, kind, stored)
