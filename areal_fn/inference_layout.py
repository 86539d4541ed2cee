"""Inference-engine layouts (SGLang, vLLM): tensor parallel shards of HF weights.

The engines load HF checkpoint names and shard them at load time; weight updates
(`update_weights_from_distributed`) send HF names, so the layout is over canonical
names. Rules (both engines):

- ``q_proj``, ``gate_proj``, ``up_proj`` (+ biases), experts' gate/up: column-wise,
  ``Shard(0)``; ``o_proj``, ``down_proj``, experts' down: row-wise, ``Shard(1)``.
- ``k_proj`` / ``v_proj``: when ``tp <= num_key_value_heads`` each rank holds
  ``kv/tp`` whole heads (``Shard(0)``); when ``tp`` exceeds them (it must then be a
  multiple), ``tp`` factors into ``tp_kv = kv`` x ``tp_rep = tp/kv``: rank ``r`` holds
  KV head ``r // tp_rep`` and each head is replicated on ``tp_rep`` ranks.
- ``embed_tokens`` / ``lm_head``: the vocabulary is padded to a multiple of 64
  (``DEFAULT_VOCAB_PADDING_SIZE``) and split evenly (``Shard(0)``); padding rows hold
  no weights.
- norms, q/k norms and the MoE router are replicated.
- pipeline stages (``p``): layer ``i`` on stage ``s`` by an even split, the first
  ``L % pp`` stages one layer longer; embeddings on stage 0, final norm and head on the
  last.

Mesh: ``(dp, pp, tp)``, replicas outermost; ``tp`` varies fastest.
"""

from .allocation import ParallelDims
from .box import Box
from .errors import LayoutError
from .layout import FusionPiece, Layout, LogicalTensor
from .mesh import Mesh
from .model import ModelSpec, layer_of
from .placement import Placement, Replicate, Shard
from .sharding import Sharding
from .typecheck import beartype

VOCAB_PADDING = 64


def _divs(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_inference(model: ModelSpec, dims: ParallelDims) -> None:
    tp, nq, nkv = dims.tp, model.num_attention_heads, model.num_key_value_heads
    if nq % tp:
        raise LayoutError(
            f"tp={tp} does not divide num_attention_heads={nq} ({model.model_type}); use tp in {_divs(nq)}"
        )
    if tp > nkv and tp % nkv:
        raise LayoutError(
            f"tp={tp} exceeds num_key_value_heads={nkv} but is not a multiple of it; the engines replicate each KV "
            f"head on tp/kv ranks, use tp in {_divs(nkv)} or a multiple of {nkv}"
        )
    if tp <= nkv and nkv % tp:
        raise LayoutError(
            f"tp={tp} does not divide num_key_value_heads={nkv}; use tp in {_divs(nkv)}"
        )
    for what, n in (
        ("intermediate_size", model.intermediate_size),
        ("moe_intermediate_size", model.moe_intermediate_size),
    ):
        if n and n % tp:
            raise LayoutError(f"tp={tp} does not divide {what}={n}; use tp in {_divs(n)}")
    if dims.pp > model.num_layers:
        raise LayoutError(f"pp={dims.pp} exceeds num_layers={model.num_layers}")


def padded_vocab(vocab: int, tp: int, multiple: int = VOCAB_PADDING) -> int:
    padded = -(-vocab // multiple) * multiple
    if padded % tp:
        raise LayoutError(
            f"padded vocabulary {padded} (vocab {vocab} padded to a multiple of {multiple}) is not divisible by tp={tp}; use a tp that divides it"
        )
    return padded


def layer_stage(layer: int, num_layers: int, pp: int) -> int:
    q, extra = divmod(num_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + q + (s < extra))
    for s in range(pp):
        if bounds[s] <= layer < bounds[s + 1]:
            return s
    raise AssertionError("layer out of range")


@beartype
def inference_layout(
    model: ModelSpec, dims: ParallelDims, *, vocab_multiple: int = VOCAB_PADDING
) -> Layout:
    """Every rank's weights in an SGLang / vLLM deployment of ``dims`` (``d``, ``t``, ``p``).

    ``vocab_multiple`` is the engines' vocabulary padding (64); 1 means unpadded, as a
    plain DTensor tensor-parallel model holds it.
    """
    if vocab_multiple < 1:
        raise LayoutError(
            f"vocab_multiple={vocab_multiple} must be >= 1 (64 for SGLang/vLLM, 1 for no padding)"
        )
    if dims.cp != 1 or dims.ep != 1 or dims.vpp != 1:
        raise LayoutError(f"inference layouts take d, t, p only; got {dims}")
    check_inference(model, dims)
    tp, nkv = dims.tp, model.num_key_value_heads
    mesh = Mesh.of(dp=dims.dp, pp=dims.pp, tp=tp)
    kv_mesh = mesh.split("tp", tp_kv=min(tp, nkv), tp_rep=max(1, tp // nkv))
    tensors = []
    vpad = padded_vocab(model.vocab_size, tp, vocab_multiple)
    for spec in model.tensors:
        name, shape = spec.name, spec.shape
        layer = layer_of(name)
        if layer is not None:
            stage = layer_stage(layer, model.num_layers, dims.pp)
        elif name.startswith("model.embed_tokens"):
            stage = 0
        else:
            stage = dims.pp - 1
        fusion = (
            FusionPiece(canonical=name, canonical_box=Box.full(shape), logical_box=Box.full(shape)),
        )
        lshape = shape
        placement: Placement = Replicate()
        m = mesh
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            lshape = (vpad, shape[1])
            placement = Shard(dim=0)
        elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            m = kv_mesh
            placement = Shard(dim=0)
        elif name.endswith(
            (
                "q_proj.weight",
                "q_proj.bias",
                "gate_proj.weight",
                "up_proj.weight",
                "gate_proj.bias",
                "up_proj.bias",
            )
        ):
            placement = Shard(dim=0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            placement = Shard(dim=1)
        placements: tuple[Placement, ...]
        if m is kv_mesh:
            placements = (Replicate(), Replicate(), placement, Replicate())
        else:
            placements = (Replicate(), Replicate(), placement)
        tensors.append(
            LogicalTensor(
                name=name,
                shape=lshape,
                dtype=model.dtype,
                fusion=fusion,
                sharding=Sharding(mesh=m, placements=placements),
                present=(("pp", stage),),
            )
        )
    return Layout(
        kind="inference", world_size=mesh.size, canonical=model.tensors, tensors=tuple(tensors)
    )
