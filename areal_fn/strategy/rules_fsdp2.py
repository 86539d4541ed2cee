"""The rules only FSDP2 (+TP, Ulysses) layouts have, for :mod:`areal_fn.strategy.rules`:
Ulysses splits whole heads, and a TP row split that ``tp`` does not divide cannot be
stored over more than two FSDP shards (the vocabulary, the shared experts' width)."""

from areal_fn.model.families.mapping import Dim
from areal_fn.model.families.roles import tp_record
from areal_fn.model.families.tp_role import TpRole
from areal_fn.model.spec import ModelSpec
from areal_fn.strategy.allocation import ParallelDims
from areal_fn.strategy.rules_fixed import Problem, _Options, _Rule


def _fsdp2_shards(d: ParallelDims, o: _Options) -> int:
    """FSDP2's ``dp_shard`` (0 when the replicas do not divide ``dp``: ``fsdp2_mesh``
    refuses that, with its own remedy)."""
    replicas = d.dp_replicate if d.dp_replicate > 1 else o.hsdp_replicas
    if replicas < 1 or d.dp % replicas:
        return 0
    return d.dp // replicas * d.cp


def _uneven_rows(name: str, rows: int, d: ParallelDims, o: _Options, remedy: str) -> Problem | None:
    """``name``'s rows, split over TP, not divisible by ``tp`` while FSDP2 shards over
    more than two ranks (:func:`~areal_fn.layouts.fsdp2.fsdp2_sharding` says why)."""
    shards = _fsdp2_shards(d, o)
    if d.tp == 1 or rows % d.tp == 0 or shards <= 2:
        return None
    return Problem(
        field="tp",
        reads=("tp", "dp", "cp"),
        text=f"{name}: dim 0 of size {rows} is not divisible by tp={d.tp}, and FSDP2 over "
        f"dp_shard={shards} (> 2) then stores shards its own placements (StridedShard) do not "
        f"describe; {remedy} or keep dp_shard = dp*cp <= 2",
    )


def _fsdp2_vocab(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    if not o.tp_embeddings:
        return None
    remedy = "use tp_embeddings=False (Fsdp2Options) for the vocabulary"
    return _uneven_rows(m.family.outer.embedding, m.vocab_size, d, o, remedy)


def _fsdp2_shared(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    # DeepSeek's shared experts, or Qwen's gated shared expert (one of them is 0)
    width = m.num_shared_experts * m.moe_intermediate_size + m.shared_expert_size
    first = next((i for i, moe in enumerate(m.moe_layers) if moe), None)
    if not width or first is None:
        return None  # no shared expert, or no MoE layer to hold one
    name = next(  # the shared experts' first column-split tensor
        t.name
        for t in m.layer_tensors(first)
        if (r := tp_record(m.family, t.name)) is not None
        and r.tp is TpRole.COLUMN
        and {Dim.SHARED_INTER, Dim.SHARED_EXPERT} & set(r.shape)
    )
    remedy = f"use a tp that divides the shared experts' width {width} ({m.model_type})"
    return _uneven_rows(name, width, d, o, remedy)


def _ulysses_heads(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    nq, tp, cp = m.num_attention_heads, d.tp, d.cp
    if cp == 1 or nq % tp:
        return None  # the heads rule reports tp first
    per = nq // tp
    if per % cp == 0:
        return None
    return Problem(
        field="cp",
        reads=("cp", "tp"),
        text=f"cp={cp} does not divide num_attention_heads={nq} / tp={tp} = {per} heads per TP "
        f"rank ({m.model_type}); fsdp's c is Ulysses sequence parallelism, whose attention "
        "all-to-all splits those heads cp ways",
    )


def _ulysses_kv(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    nkv, tp, cp = m.num_key_value_heads, d.tp, d.cp
    if cp == 1 or nkv % tp:
        return None
    per = nkv // tp
    if per % cp == 0 or cp % per == 0:
        return None
    return Problem(
        field="cp",
        reads=("cp", "tp"),
        text=f"cp={cp} and num_key_value_heads={nkv} / tp={tp} = {per} KV heads per TP rank "
        f"({m.model_type}) do not divide one another; Ulysses splits KV heads cp ways, "
        "repeating them when cp is a multiple",
    )


def _fsdp2_family_tp(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    """A family the FSDP2 engine cannot split over TP (its ``fsdp2_tp_refusal``)."""
    why = m.family.fsdp2_tp_refusal
    if d.tp == 1 or not why:
        return None
    return Problem(field="tp", reads=("tp",), text=f"tp={d.tp}: {why}")


def linear_key_heads(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    """Gated-delta-net layers split by key-head group (:mod:`areal_fn.model.linear_tp`):
    ``tp`` must divide ``linear_num_key_heads`` (the FSDP2 engine and the inference engines)."""
    la = m.linear_attention
    if la is None or la.key_heads % d.tp == 0:
        return None
    return Problem(
        field="tp",
        reads=("tp",),
        text=f"tp={d.tp} does not divide linear_num_key_heads={la.key_heads} ({m.model_type}); "
        "each tp rank runs whole key-head groups of the linear-attention layers, as "
        "Megatron-Core and vLLM split them",
    )


def _fsdp2_family_sequence(m: ModelSpec, d: ParallelDims, o: _Options) -> Problem | None:
    """A family whose layers carry a state along the sequence (its ``sequence_refusal``):
    no Ulysses split."""
    why = m.family.sequence_refusal
    if d.cp == 1 or not why:
        return None
    return Problem(field="cp", reads=("cp",), text=f"cp={d.cp}: {why}")


#: In the order ``check_dims`` applies them, after the rules FSDP2 shares.
FSDP2_RULES: tuple[_Rule, ...] = (
    _fsdp2_family_tp,
    linear_key_heads,
    _fsdp2_family_sequence,
    _ulysses_heads,
    _ulysses_kv,
    _fsdp2_vocab,
    _fsdp2_shared,
)
