"""A decoder layer's canonical tensors and its HF <-> Megatron-Core correspondence, as
tables of typed records.

A family's :attr:`~areal_fn.model.families.Family.canonical` is a tuple of
:class:`HfTensor` records: the checkpoint tensors of one decoder layer, their shapes in
named model dimensions (:class:`Dim`), in state-dict order;
:attr:`~areal_fn.model.spec.ModelSpec.tensors` interprets it.

A family's :attr:`~areal_fn.model.families.Family.megatron` is a tuple of
:class:`MegatronTensor` records, one per Megatron-Core parameter of a decoder layer;
:func:`areal_fn.layouts.megatron.megatron_layout` interprets the table (one generic
function), so adding a family is writing its table. Names are relative to the layer
prefix: ``decoder.layers.{i}.`` on the Megatron side, ``model.layers.{i}.`` on the HF
side. The embedding, the final norm and the output layer are the family's
:attr:`~areal_fn.model.families.Family.outer`, not in the table.

A record says

- ``local``: the parameter's name under Megatron's local layer spec; ``te`` its name
  under the Transformer-Engine spec where that differs; ``grouped`` the name of an
  expert tensor under grouped GEMM (``{local}`` is the expert's index on its EP rank);
- ``hf``: the canonical (HF checkpoint) tensors it is made of (``{e}``: the expert);
- ``fusion``: how those tensors are laid into it (:class:`Fusion`);
- ``tp``: its placement over the tensor-parallel axis (``tp`` on the dense mesh,
  ``etp`` on the expert mesh for ``expert`` records); ``te_tp`` its placement under the
  Transformer-Engine spec where that differs;
- ``when``: a boolean :class:`~areal_fn.model.spec.ModelSpec` field that must be true
  for the parameter to exist (``qkv_bias``, ``qk_norm``, ...), or ``None``;
- ``layers``: which layers have it (:class:`LayerKind`); ``mixer``: which token mixer
  a layer must have for it (:class:`Mixer`: full or gated-delta-net linear attention).
"""

import enum
from collections.abc import Iterable, Mapping
from typing import TypeVar

import attrs

from areal_fn.errors import SpecError
from areal_fn.model.families.dim import Dim as Dim
from areal_fn.model.families.mixer import Mixer
from areal_fn.model.families.tp_role import TpRole
from areal_fn.sharding.placement import Placement, Replicate, Shard, StridedShard


class Fusion(enum.Enum):
    """How the canonical tensors of a record are laid into the Megatron parameter."""

    #: One canonical tensor, copied whole.
    WHOLE = "whole"
    #: ``[q heads of group g; k_g; v_g]`` per query group ``g`` (sources: q, k, v).
    QKV = "qkv"
    #: ``[gate; up]`` stacked along rows (sources: gate, up).
    GATE_UP = "gate_up"
    #: Expert ``e`` of one stacked ``[E, ..., n]`` tensor (gpt-oss), its last dim first:
    #: ``x[e].T`` for a weight used as ``h @ W`` (``down_proj [E, I, H]`` -> ``[H, I]``),
    #: ``x[e]`` for a bias.
    EXPERT = "expert"
    #: Expert ``e`` of one stacked ``[E, ..., 2I]`` tensor whose last dim interleaves gate
    #: and up (gpt-oss ``gate_up_proj``): ``[x[e][..., ::2].T; x[e][..., 1::2].T]``, i.e.
    #: ``[gate; up]`` rows, pieces with a stride of 2 and a transpose.
    EXPERT_GLU = "expert_glu"
    #: MLA's q (per head ``[nope; rope]``) and kv_a (``[latent; rope]``) projections: whole,
    #: or with ``rope_interleave=false`` their rope rows interleaved (``mla_rope_fusion``).
    MLA_Q = "mla_q"
    MLA_KV_A = "mla_kv_a"
    #: Gated attention: per query group ``[q heads of g; their gates; k_g; v_g]``.
    GATED_QKV = "gated_qkv"
    #: GatedDeltaNet's in_proj (Qwen3-Next's, Qwen3.5's sources), conv1d: per TP rank.
    GDN_IN_PROJ = "gdn_in_proj"
    GDN_IN_PROJ_SPLIT = "gdn_in_proj_split"
    GDN_CONV = "gdn_conv"

    def __repr__(self) -> str:
        return f"Fusion.{self.name}"


#: Number of canonical sources each fusion takes.
FUSION_SOURCES = {f: 1 for f in Fusion} | {Fusion.QKV: 3, Fusion.GATED_QKV: 3, Fusion.GATE_UP: 2}
FUSION_SOURCES |= {Fusion.GDN_IN_PROJ: 2, Fusion.GDN_IN_PROJ_SPLIT: 4}

#: Fusions that take expert ``e`` out of one stacked tensor of every expert.
STACKED_FUSIONS = (Fusion.EXPERT, Fusion.EXPERT_GLU)


class LayerKind(enum.Enum):
    """Which decoder layers hold a parameter."""

    ALL = "all"
    #: Layers with a dense MLP.
    DENSE = "dense"
    #: Layers with routed experts.
    MOE = "moe"

    def __repr__(self) -> str:
        return f"LayerKind.{self.name}"


#: ModelSpec fields a record's ``when`` may name (a record exists when the field is
#: true, or non-zero for ``num_shared_experts``, ``q_lora_rank`` and ``index_n_heads``, which
#: is 0 on a layer that reuses another's indexer; ``q_direct``: MLA without a query LoRA).
CONDITIONS = (
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
    "router_bias",
    "num_shared_experts",
    "shared_expert_size",
    "q_lora_rank",
    "q_direct",
    "index_n_heads",
)


def _dims(value: Iterable[Dim]) -> tuple[Dim, ...]:
    return tuple(value)


def _check_when(what: str, when: str | None) -> None:
    if when is not None and when not in CONDITIONS:
        raise SpecError(
            f"{what}: when={when!r} is not a ModelSpec flag; use one of {CONDITIONS} or None"
        )


def _check_hf_record(inst: "HfTensor") -> None:
    _check_when(f"HfTensor {inst.name!r}", inst.when)
    if ("{e}" in inst.name) != (inst.layers is LayerKind.MOE and inst.expert):
        raise SpecError(
            f"HfTensor {inst.name!r}: expert={inst.expert}, layers={inst.layers!r}; a per-expert "
            "tensor is named with '{e}', has expert=True and belongs to MoE layers"
        )
    if inst.stacked and (
        inst.expert or inst.layers is not LayerKind.MOE or inst.shape[:1] != (Dim.EXPERTS,)
    ):
        raise SpecError(
            f"HfTensor {inst.name!r}: stacked=True with expert={inst.expert}, "
            f"layers={inst.layers!r}, shape={inst.shape!r}; a stacked tensor holds every routed "
            "expert along its first dim (Dim.EXPERTS), is not per-expert and belongs to MoE layers"
        )


@attrs.frozen(kw_only=True)
class HfTensor:
    """One canonical (HF checkpoint) tensor of a decoder layer.

    ``name`` is relative to ``model.layers.{i}.``; ``{e}`` names the expert of a
    per-expert tensor (``expert=True``: one tensor per routed expert; a run of such
    records is laid out expert-major). ``when`` and ``layers`` as for
    :class:`MegatronTensor`. ``dtype``: the tensor's own dtype where the model keeps it
    in one whatever the model's dtype (a router in float32), else ``None``. ``buffer``:
    a persistent buffer in transformers' module, not a parameter (not trained, not
    sharded by FSDP2). ``stacked``: one tensor holds every routed expert along its first
    dim (gpt-oss ``mlp.experts.gate_up_proj [E, H, 2I]``); a token uses
    ``num_experts_per_tok`` of its ``E`` slices. ``tp``: its :class:`TpRole`.
    """

    name: str
    shape: tuple[Dim, ...] = attrs.field(converter=_dims)
    when: str | None = None
    layers: LayerKind = LayerKind.ALL
    expert: bool = False
    dtype: str | None = None
    buffer: bool = False
    stacked: bool = False
    mixer: Mixer = Mixer.ANY
    tp: TpRole = TpRole.REPLICATE

    def __attrs_post_init__(self) -> None:
        _check_hf_record(self)


def _strs(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _check_record(inst: "MegatronTensor") -> None:
    need = FUSION_SOURCES[inst.fusion]
    if len(inst.hf) != need:
        raise SpecError(
            f"MegatronTensor {inst.local!r}: fusion {inst.fusion!r} takes {need} canonical "
            f"tensors, got hf={inst.hf!r}"
        )
    _check_when(f"MegatronTensor {inst.local!r}", inst.when)
    per_expert = ["{e}" in h for h in inst.hf]
    stacked = inst.fusion in STACKED_FUSIONS
    if stacked and (not inst.expert or any(per_expert)):
        raise SpecError(
            f"MegatronTensor {inst.local!r}: fusion {inst.fusion!r} takes expert e out of one "
            f"stacked tensor, so the record is an expert record (expert=True) whose source names "
            f"no '{{e}}'; got expert={inst.expert}, hf={inst.hf!r}"
        )
    if not stacked and (inst.expert != all(per_expert) or any(per_expert) != all(per_expert)):
        raise SpecError(
            f"MegatronTensor {inst.local!r}: expert={inst.expert} but hf={inst.hf!r}; an "
            "expert record names every source with '{e}', others name none"
        )
    if inst.expert and ("{local}" not in inst.local or "{local}" not in (inst.grouped or "")):
        raise SpecError(
            f"MegatronTensor {inst.local!r}: an expert record needs '{{local}}' in local "
            f"and in grouped (got grouped={inst.grouped!r})"
        )
    if inst.expert and inst.layers is not LayerKind.MOE:
        raise SpecError(f"MegatronTensor {inst.local!r}: expert records belong to MoE layers")


@attrs.frozen(kw_only=True)
class MegatronTensor:
    """One Megatron-Core parameter of a decoder layer and its canonical sources."""

    local: str
    hf: tuple[str, ...] = attrs.field(converter=_strs)
    tp: Placement
    fusion: Fusion = Fusion.WHOLE
    te: str | None = None
    te_tp: Placement | None = None
    grouped: str | None = None
    expert: bool = False
    when: str | None = None
    layers: LayerKind = LayerKind.ALL
    mixer: Mixer = Mixer.ANY

    def __attrs_post_init__(self) -> None:
        _check_record(self)

    def name(self, naming: str, *, grouped_gemm: bool = False) -> str:
        """The parameter's name under ``naming`` (``"local"`` or ``"te"``)."""
        if self.expert and grouped_gemm and self.grouped is not None:
            return self.grouped
        if naming == "te" and self.te is not None:
            return self.te
        return self.local

    def placement(self, naming: str) -> Placement:
        """The parameter's TP placement under ``naming`` (``"local"`` or ``"te"``)."""
        if naming == "te" and self.te_tp is not None:
            return self.te_tp
        return self.tp


# -- building blocks the families compose ------------------------------------------------


def linear_hf(
    name: str, out: Dim, inp: Dim, bias: str | None, tp: TpRole, layers: LayerKind = LayerKind.ALL
) -> tuple[HfTensor, ...]:
    """A ``Linear``'s weight ``[out, inp]`` and optional bias (when ``bias``), split as ``tp``
    (a row-split layer's bias is whole on every rank, added after the sum)."""
    weight = HfTensor(name=f"{name}.weight", shape=(out, inp), layers=layers, tp=tp)
    if bias is None:
        return (weight,)
    btp = TpRole.REPLICATE if tp is TpRole.ROW else tp
    return weight, HfTensor(name=f"{name}.bias", shape=(out,), when=bias, layers=layers, tp=btp)


#: Canonical tensors of grouped-query attention: q/k/v (optional biases), o_proj, q/k norms.
GQA_ATTENTION_HF: tuple[HfTensor, ...] = (
    *linear_hf("self_attn.q_proj", Dim.Q_OUT, Dim.HIDDEN, "qkv_bias", TpRole.COLUMN),
    *linear_hf("self_attn.k_proj", Dim.KV_OUT, Dim.HIDDEN, "qkv_bias", TpRole.KV),
    *linear_hf("self_attn.v_proj", Dim.KV_OUT, Dim.HIDDEN, "qkv_bias", TpRole.KV),
    *linear_hf("self_attn.o_proj", Dim.HIDDEN, Dim.Q_OUT, "o_bias", TpRole.ROW),
    *(
        HfTensor(name=n, shape=(Dim.HEAD_DIM,), when="qk_norm", tp=TpRole.HEAD_NORM)
        for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    ),
)

#: Canonical tensors of a dense SwiGLU MLP (optional biases).
SWIGLU_MLP_HF: tuple[HfTensor, ...] = (
    *linear_hf("mlp.gate_proj", Dim.INTER, Dim.HIDDEN, "mlp_bias", TpRole.COLUMN, LayerKind.DENSE),
    *linear_hf("mlp.up_proj", Dim.INTER, Dim.HIDDEN, "mlp_bias", TpRole.COLUMN, LayerKind.DENSE),
    *linear_hf("mlp.down_proj", Dim.HIDDEN, Dim.INTER, "mlp_bias", TpRole.ROW, LayerKind.DENSE),
)

#: Canonical tensors of routed SwiGLU experts (per expert ``gate``, ``up``, ``down``),
#: then the router.
ROUTED_EXPERTS_HF: tuple[HfTensor, ...] = (
    *(
        HfTensor(
            name=f"mlp.experts.{{e}}.{part}.weight",
            shape=shape,
            layers=LayerKind.MOE,
            expert=True,
            tp=tp,
        )
        for part, shape, tp in (
            ("gate_proj", (Dim.MOE_INTER, Dim.HIDDEN), TpRole.COLUMN),
            ("up_proj", (Dim.MOE_INTER, Dim.HIDDEN), TpRole.COLUMN),
            ("down_proj", (Dim.HIDDEN, Dim.MOE_INTER), TpRole.ROW),
        )
    ),
    HfTensor(name="mlp.gate.weight", shape=(Dim.EXPERTS, Dim.HIDDEN), layers=LayerKind.MOE),
)

#: The two RMSNorms of a pre-norm decoder layer, last in the state dict.
LAYER_NORMS_HF: tuple[HfTensor, ...] = (
    HfTensor(name="input_layernorm.weight", shape=(Dim.HIDDEN,)),
    HfTensor(name="post_attention_layernorm.weight", shape=(Dim.HIDDEN,)),
)

_COLS = Shard(dim=1)
_ROWS = Shard(dim=0)
_GATE_UP_ROWS = StridedShard(dim=0, split_factor=2)

#: Grouped-query attention: fused QKV (optional biases), optional q/k norms, o_proj.
GQA_ATTENTION: tuple[MegatronTensor, ...] = (
    MegatronTensor(
        local="input_layernorm.weight",
        te="self_attention.linear_qkv.layer_norm_weight",
        hf="input_layernorm.weight",
        tp=Replicate(),
    ),
    MegatronTensor(
        local="self_attention.linear_qkv.weight",
        hf=(
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ),
        fusion=Fusion.QKV,
        tp=_ROWS,
    ),
    MegatronTensor(
        local="self_attention.linear_qkv.bias",
        hf=("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        fusion=Fusion.QKV,
        tp=_ROWS,
        when="qkv_bias",
    ),
    MegatronTensor(
        local="self_attention.q_layernorm.weight",
        hf="self_attn.q_norm.weight",
        tp=Replicate(),
        when="qk_norm",
    ),
    MegatronTensor(
        local="self_attention.k_layernorm.weight",
        hf="self_attn.k_norm.weight",
        tp=Replicate(),
        when="qk_norm",
    ),
    MegatronTensor(
        local="self_attention.linear_proj.weight", hf="self_attn.o_proj.weight", tp=_COLS
    ),
    MegatronTensor(
        local="self_attention.linear_proj.bias",
        hf="self_attn.o_proj.bias",
        tp=Replicate(),
        when="o_bias",
    ),
)

#: A dense SwiGLU MLP: ``linear_fc1 = [gate; up]`` (strided over TP), ``linear_fc2``.
SWIGLU_MLP: tuple[MegatronTensor, ...] = (
    MegatronTensor(
        local="pre_mlp_layernorm.weight",
        te="mlp.linear_fc1.layer_norm_weight",
        hf="post_attention_layernorm.weight",
        tp=Replicate(),
        layers=LayerKind.DENSE,
    ),
    MegatronTensor(
        local="mlp.linear_fc1.weight",
        hf=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        fusion=Fusion.GATE_UP,
        tp=_GATE_UP_ROWS,
        layers=LayerKind.DENSE,
    ),
    MegatronTensor(
        local="mlp.linear_fc1.bias",
        hf=("mlp.gate_proj.bias", "mlp.up_proj.bias"),
        fusion=Fusion.GATE_UP,
        tp=_GATE_UP_ROWS,
        when="mlp_bias",
        layers=LayerKind.DENSE,
    ),
    MegatronTensor(
        local="mlp.linear_fc2.weight", hf="mlp.down_proj.weight", tp=_COLS, layers=LayerKind.DENSE
    ),
    MegatronTensor(
        local="mlp.linear_fc2.bias",
        hf="mlp.down_proj.bias",
        tp=Replicate(),
        when="mlp_bias",
        layers=LayerKind.DENSE,
    ),
)

#: Routed SwiGLU experts behind a linear router (no shared expert); the MoE layer's
#: pre-MLP norm keeps its own name under the TE spec.
ROUTED_EXPERTS: tuple[MegatronTensor, ...] = (
    MegatronTensor(
        local="pre_mlp_layernorm.weight",
        hf="post_attention_layernorm.weight",
        tp=Replicate(),
        layers=LayerKind.MOE,
    ),
    MegatronTensor(
        local="mlp.router.weight", hf="mlp.gate.weight", tp=Replicate(), layers=LayerKind.MOE
    ),
    MegatronTensor(
        local="mlp.experts.local_experts.{local}.linear_fc1.weight",
        grouped="mlp.experts.linear_fc1.weight{local}",
        hf=("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        fusion=Fusion.GATE_UP,
        tp=_GATE_UP_ROWS,
        expert=True,
        layers=LayerKind.MOE,
    ),
    MegatronTensor(
        local="mlp.experts.local_experts.{local}.linear_fc2.weight",
        grouped="mlp.experts.linear_fc2.weight{local}",
        hf="mlp.experts.{e}.down_proj.weight",
        tp=_COLS,
        expert=True,
        layers=LayerKind.MOE,
    ),
)


# -- interpreting the tables --------------------------------------------------------------

R = TypeVar("R", HfTensor, MegatronTensor)


def layer_tensors(
    table: tuple[HfTensor, ...],
    prefix: str,
    *,
    moe: bool,
    flags: Mapping[str, object],
    sizes: Mapping[Dim, int],
    num_experts: int,
    linear: bool = False,
) -> list[tuple[str, tuple[int, ...], str | None]]:
    """One decoder layer's canonical ``(name, shape, dtype or None)`` from ``table``, in order.

    ``prefix`` is ``model.layers.{i}.``; ``moe`` says whether the layer has routed
    experts; ``flags`` gives each of :data:`CONDITIONS`; ``sizes`` each :class:`Dim`. A
    run of per-expert records is laid out expert-major (expert 0's tensors, then expert
    1's, ...), as checkpoints store them. ``linear``: the layer's mixer is linear attention.
    """
    out: list[tuple[str, tuple[int, ...], str | None]] = []
    for run in expert_runs(select(table, moe=moe, flags=flags, linear=linear)):
        for e in range(num_experts) if run[0].expert else (None,):
            for r in run:
                name = r.name.format(e=e) if e is not None else r.name
                out.append((prefix + name, tuple(sizes[d] for d in r.shape), r.dtype))
    return out


def select(
    table: "tuple[R, ...]", *, moe: bool, flags: Mapping[str, object], linear: bool = False
) -> "list[R]":
    """The records of ``table`` a layer has: its kinds (``moe``, ``linear``: its mixer is
    linear attention) and its ``when`` flags."""
    kind = LayerKind.MOE if moe else LayerKind.DENSE
    mixer = Mixer.LINEAR if linear else Mixer.ATTENTION
    return [
        r
        for r in table
        if r.layers in (LayerKind.ALL, kind)
        and r.mixer in (Mixer.ANY, mixer)
        and (r.when is None or bool(flags[r.when]))
    ]


def expert_runs(rows: "list[R]") -> "list[list[R]]":
    """``rows`` cut into runs: each non-expert record alone, consecutive expert records
    together (a run is expanded expert-major)."""
    out: list[list[R]] = []
    for r in rows:
        if r.expert and out and out[-1][0].expert:
            out[-1].append(r)
        else:
            out.append([r])
    return out
