"""Megatron-Core's own multi-token-prediction block, built on CPU: what the megatron
layout's refusal of MTP layers says (docs/models.md) is what ``GPTModel`` holds.

A ``GPTModel`` with ``mtp_num_layers=1`` (its local layer spec, multi-latent attention,
routed and shared experts) holds ``mtp.layers.0.{enorm, hnorm, eh_proj,
transformer_layer.*, final_layernorm}`` and no embedding or output layer of its own: the
MTP layer uses the main model's. So the checkpoint's own copies
(``model.layers.{N}.embed_tokens``, ``shared_head.head``) have no parameter to go to,
and the layout refuses the layer rather than drop them. The rest of the MTP layer maps
one to one: its decoder layer has the names of the main model's MoE layers, and
``eh_proj`` has the checkpoint's shape ``[H, 2H]``.
"""

import importlib.util
import warnings

import pytest

from areal_fn import ParallelDims, megatron_layout
from areal_fn.model.spec import model_from_hf_config
from tests.laws.test_mtp import TINY
from tests.oracles.test_memory_real import _single_process_group

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="needs megatron-core"
)


def _mtp_gpt_model_parameters() -> dict[str, tuple[int, ...]]:
    with warnings.catch_warnings(), _single_process_group():
        warnings.simplefilter("ignore")  # Megatron warns that Apex / TE are missing
        from areal_fn.runtime.megatron.build import (
            MegatronSizes,
            layer_spec,
            megatron_session,
            rope_kwargs,
        )
        from areal_fn.runtime.megatron.config import arch_of, transformer_config

        arch = arch_of(model_from_hf_config({**TINY, "torch_dtype": "float32"}))
        with megatron_session(MegatronSizes()):
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
            from megatron.core.models.gpt.gpt_model import GPTModel

            config = transformer_config(arch, MegatronSizes())
            config.mtp_num_layers = 1
            spec = layer_spec(arch, config)
            model = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=arch["vocab_size"],
                max_sequence_length=64,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=False,
                mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
                **rope_kwargs(arch),
            )
            # the router's expert_bias is a persistent buffer, a layout tensor like a parameter
            held = [*model.named_parameters(), *model.named_buffers()]
            keys = model.state_dict().keys()
            return {n: tuple(t.shape) for n, t in held if n in keys}


def test_megatron_mtp_block_has_no_embedding_or_output_layer_of_its_own() -> None:
    params = _mtp_gpt_model_parameters()
    spec = model_from_hf_config(TINY, mtp=True)
    hidden = spec.hidden_size
    outside = sorted(n for n in params if not n.startswith(("decoder.", "mtp.")))
    assert outside == ["embedding.word_embeddings.weight", "output_layer.weight"]
    mtp = {n.removeprefix("mtp.layers.0."): s for n, s in params.items() if n.startswith("mtp.")}
    own = {n: s for n, s in mtp.items() if not n.startswith("transformer_layer.")}
    assert own == {
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": spec.tensor("model.layers.2.eh_proj.weight").shape,
        "final_layernorm.weight": spec.tensor("model.layers.2.shared_head.norm.weight").shape,
    }
    # its decoder layer is a MoE layer of the main model, name for name and shape for shape
    main = megatron_layout(model_from_hf_config(TINY), ParallelDims())
    last = {
        t.name.removeprefix("decoder.layers.1."): t.shape
        for t in main.local_tensors(0)
        if t.name.startswith("decoder.layers.1.")
    }
    layer = {n.removeprefix("transformer_layer."): s for n, s in mtp.items() if n not in own}
    assert layer == last
