"""Multi-token-prediction (MTP) layers as canonical tensors (DeepSeek-V3, GLM-4.5).

A DeepSeek-V3 or GLM-4.5 checkpoint holds, after its ``num_hidden_layers`` decoder
layers, ``num_nextn_predict_layers`` MTP layers under the next layer indices
(``model.layers.61.*`` in DeepSeek-V3, ``model.layers.92.*`` in GLM-4.5). transformers
builds no module for them and ``save_pretrained`` does not write them, so they are
canonical tensors only when asked for:
:func:`~areal_fn.model.spec.model_from_hf_config` with ``mtp=True`` sets
:attr:`~areal_fn.model.spec.ModelSpec.mtp_layers` to the config's
``num_nextn_predict_layers``.

MTP layer ``j`` (index ``i = num_layers + j``) holds, in this order:

- ``model.layers.{i}.embed_tokens.weight`` ``[vocab, H]`` (its own copy of the
  embedding, as the checkpoint stores it);
- ``enorm.weight`` ``[H]`` and ``hnorm.weight`` ``[H]`` (the norms of the next token's
  embedding and of the previous depth's hidden state);
- ``eh_proj.weight`` ``[H, 2H]`` (the projection of their concatenation,
  ``[enorm(e); hnorm(h)]``);
- one decoder layer, the family's canonical table with routed experts (its index is
  past ``first_k_dense_replace``);
- ``shared_head.norm.weight`` ``[H]`` and ``shared_head.head.weight`` ``[vocab, H]``.

They come after every other canonical tensor, layer by layer.

What each layout does with them (:func:`mtp_refusal` words the refusals):

- inference layouts (SGLang, vLLM) carry them: the decoder layer's tensors placed by the
  same rules as a main layer's, ``embed_tokens`` and ``shared_head.head`` padded and
  split over ``tp`` like the main embedding, the norms and ``eh_proj`` replicated, all
  on the last pipeline stage;
- the FSDP2 layout refuses them: it trains the transformers model, which has no MTP
  layers;
- the Megatron-Core layout carries them as Megatron-Core's MTP block on the last chunk
  (``mtp.layers.{j}.{enorm, hnorm, eh_proj, transformer_layer.*, final_layernorm}``,
  ``eh_proj`` rows split over ``tp``, the decoder layer placed like a main MoE layer).
  The block uses the main model's embedding and output layer, so the checkpoint's own
  copies (``embed_tokens``, ``shared_head.head``) are *tied* pieces of them
  (:class:`~areal_fn.layouts.layout.FusionPiece`): conversion refuses copies that differ
  from the main tensors and writes them back as copies. With ``pp > 1`` the last stage
  holds a copy of the embedding (``embedding.word_embeddings.weight``), as Megatron-Core
  builds it. Every MTP layer is in the last chunk, with the loss; with more than one
  chunk the default split (``stages_for``) counts them as layers of that chunk, which
  may then hold no decoder layer (``...|mL``), and the final norm stays with the last
  decoder layer, as Megatron-Core keeps it when there are MTP layers.

They are never dropped: a checkpoint that holds them is read by a spec with
``mtp=True`` or refused by the strict readers as holding unexpected tensors.
"""

from collections.abc import Iterable, Mapping
from typing import Any

from areal_fn.errors import ConversionError, LayoutError, SpecError
from areal_fn.model.families.mapping import Dim, HfTensor, layer_tensors
from areal_fn.model.families.serving import MtpBlock
from areal_fn.model.tensor_spec import layer_of

#: The config key giving the number of MTP layers.
MTP_KEY = "num_nextn_predict_layers"
Shapes = list[tuple[str, tuple[int, ...], str | None]]


def mtp_shapes(
    table: tuple[HfTensor, ...],
    block: MtpBlock | None,
    *,
    num_layers: int,
    mtp_layers: int,
    vocab: int,
    hidden: int,
    moe: bool,
    flags: Mapping[str, object],
    sizes: Mapping[Dim, int],
    num_experts: int,
) -> Shapes:
    """The canonical ``(name, shape, dtype or None)`` of every MTP layer, in order
    (``block``: the family's names of an MTP layer's own tensors)."""
    if mtp_layers and block is None:
        raise SpecError(f"mtp_layers={mtp_layers}: the family has no MTP block (Family.mtp)")
    out: Shapes = []
    for j in range(mtp_layers):
        p, b = f"model.layers.{num_layers + j}.", block or MtpBlock()
        out += [
            (p + b.embedding, (vocab, hidden), None),
            (p + b.enorm, (hidden,), None),
            (p + b.hnorm, (hidden,), None),
            (p + b.eh_proj, (hidden, 2 * hidden), None),
        ]
        out += layer_tensors(table, p, moe=moe, flags=flags, sizes=sizes, num_experts=num_experts)
        out += [(p + b.head_norm, (hidden,), None), (p + b.head, (vocab, hidden), None)]
    return out


def mtp_families() -> list[str]:
    """The ``model_type`` of every family that may have MTP layers."""
    from areal_fn.model.families import FAMILIES

    return sorted(f.model_type for f in FAMILIES.values() if f.mtp)


def mtp_names(names: Iterable[str], model: Any) -> tuple[str, ...]:
    """The names among ``names`` (a checkpoint's) of multi-token-prediction layers that
    ``model`` (a :class:`~areal_fn.model.spec.ModelSpec`) does not hold: ``model.layers.{i}.*``
    with ``i >= num_layers + mtp_layers``. ``ConversionError`` for a model whose family has
    no MTP layers (such names are then not MTP layers: they stay unexpected tensors)."""
    if not model.family.mtp:
        raise ConversionError(
            f"drop_mtp=True: {model.model_type} has no multi-token-prediction layers to leave "
            f"out (families with them: {', '.join(mtp_families())}); drop drop_mtp=True"
        )
    first = model.num_layers + model.mtp_layers
    return tuple(n for n in names if (layer_of(n) or 0) >= first)


def moe_at(model: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` of ``model`` has routed experts; an MTP layer's index
    (``num_layers + j``) included: it has them when the family does."""
    return bool(model.moe_layers[layer] if layer < model.num_layers else model.family.moe)


def check_mtp(*, mtp_layers: int, num_layers: int, kind: str) -> None:
    """Raise :func:`mtp_refusal`'s error when a ``kind`` layout (``fsdp2``, ``megatron``,
    an inference kind) cannot hold ``mtp_layers`` MTP layers: the trainers cannot."""
    if mtp_layers and kind == "fsdp2":
        raise mtp_refusal(mtp_layers=mtp_layers, num_layers=num_layers, backend="fsdp")


def mtp_refusal(*, mtp_layers: int, num_layers: int, backend: str) -> LayoutError:
    """The error of a trainer layout (``fsdp``, ``megatron``) asked to hold MTP layers."""
    first, last = num_layers, num_layers + mtp_layers - 1
    where = f"model.layers.{first}.*" + (f" .. model.layers.{last}.*" if last > first else "")
    why = {
        "fsdp": "the fsdp backend trains the transformers model, which has no MTP layers",
        "megatron": (
            "Megatron-Core's MTP block shares the main model's embedding and output layer, "
            "so the checkpoint's own copies (embed_tokens, shared_head.head) have no "
            "parameter to go to; the megatron layout does not hold MTP layers"
        ),
    }[backend]
    return LayoutError(
        f"the model has {mtp_layers} multi-token-prediction layer(s) ({where}, "
        f"mtp_layers={mtp_layers}); {why}. Inference layouts (sglang, vllm) carry them. To "
        f"train with {backend}, build the model without them (model_from_hf_config(config), "
        f"mtp=False, the default; on the command line leave out --mtp) and read the checkpoint "
        f"with drop_mtp=True (HfCheckpoint.check, convert_to_local, convert_to_torch_dist), "
        f"which leaves {where} out"
    )
