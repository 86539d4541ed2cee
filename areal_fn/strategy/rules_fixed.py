"""The degrees each layout kind cannot express, and why: :mod:`areal_fn.strategy.rules`
refuses them (``fixed`` problems, whose text already says the remedy: the degree must be 1).

Also the records every rule of :mod:`~areal_fn.strategy.rules` returns and reads.
"""

from collections.abc import Callable

import attrs

from areal_fn.model.spec import ModelSpec
from areal_fn.strategy.allocation import ParallelDims


@attrs.frozen(kw_only=True)
class Problem:
    """One rule that ``dims`` break: ``text`` (what, the numbers, the rule), the degree
    the remedy changes (``field``) and every degree the rule reads (``reads``).
    ``fixed``: the text already says the remedy (the degree must be 1)."""

    field: str
    reads: tuple[str, ...]
    text: str
    fixed: bool = False


@attrs.frozen(kw_only=True)
class _Options:
    vocab_multiple: int
    tp_embeddings: bool
    hsdp_replicas: int


_Rule = Callable[[ModelSpec, ParallelDims, _Options], Problem | None]


def _fixed(table: dict[str, str]) -> list[_Rule]:
    def rule(field: str, why: str) -> _Rule:
        def check(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
            value = getattr(d, field)
            if value == 1:
                return None
            return Problem(field=field, reads=(field,), text=f"{field}={value}: {why}", fixed=True)

        return check

    return [rule(f, why) for f, why in table.items()]


_FSDP2_FIXED = {
    "pp": "an FSDP2 layout has no pipeline stages (every rank holds a shard of every layer); "
    "use pp=1, or megatron for pipeline parallelism",
    "ep": "an FSDP2 layout does not split experts across ranks (FSDP2 shards the stacked "
    "experts like any other parameter); use ep=1, or megatron for expert parallelism",
    "etp": "an FSDP2 layout does not shard experts over tensor parallel ranks (its TP leaves "
    "experts replicated); use etp=1, or megatron for expert tensor parallelism",
    "vpp": "an FSDP2 layout has no pipeline stages to interleave; use vpp=1, or megatron "
    "with pp >= 2 for virtual pipeline stages",
}
_INFERENCE_FIXED = {
    "cp": "an inference layout takes d, t, p only; use cp=1",
    "ep": "an inference layout takes d, t, p only (the engines shard experts by their own "
    "options); use ep=1",
    "etp": "an inference layout takes d, t, p only (the engines shard experts by their own "
    "options); use etp=1",
    "vpp": "an inference layout takes d, t, p only; use vpp=1",
    "dp_replicate": "HSDP replicas (fsdp:d2x4) are an FSDP2 layout's; an inference layout "
    "takes dp as one number; use dp_replicate=1",
}
_MEGATRON_FIXED = {
    "dp_replicate": "HSDP replicas (fsdp:d2x4) are an FSDP2 layout's; a Megatron layout "
    "takes dp as one number; use dp_replicate=1",
}
