"""A canonical tensor's record and :class:`~areal_fn.model.families.tp_role.TpRole` in its
family's decoder-layer table, looked up by the tensor's checkpoint name."""

import re

from areal_fn.model.families import Family
from areal_fn.model.families.mapping import HfTensor
from areal_fn.model.families.tp_role import TpRole

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def tp_record(family: Family, name: str) -> HfTensor | None:
    """The record of ``family``'s decoder-layer table that canonical tensor ``name`` comes
    from (a per-expert tensor's ``{e}`` record), or ``None`` for a tensor outside the
    table (embedding, final norm, output layer, an MTP layer's own tensors)."""
    m = _LAYER.match(name)
    if m is None:
        return None
    rel = _EXPERT.sub(".experts.{e}.", m.group(2), count=1)
    return _records(family).get(rel)


def tp_role(family: Family, name: str) -> TpRole:
    """The :class:`TpRole` of canonical tensor ``name`` (``REPLICATE`` outside the table)."""
    rec = tp_record(family, name)
    return TpRole.REPLICATE if rec is None else rec.tp


_CACHE: dict[str, dict[str, HfTensor]] = {}


def _records(family: Family) -> dict[str, HfTensor]:
    """Relative name -> record of ``family``'s table (records sharing a name differ only
    in which layers hold them; a law checks that they agree on the role)."""
    found = _CACHE.get(family.model_type)
    if found is None:
        found = {}
        for r in family.canonical:
            found.setdefault(r.name, r)
        _CACHE[family.model_type] = found
    return found


def role_conflicts(family: Family) -> list[str]:
    """Names that ``family``'s table gives in several records with different roles,
    expert or stacked flags (one name must mean one split)."""
    seen: dict[str, tuple[TpRole, bool, bool]] = {}
    bad = []
    for r in family.canonical:
        key = (r.tp, r.expert, r.stacked)
        if seen.setdefault(r.name, key) != key:
            bad.append(r.name)
    return bad
