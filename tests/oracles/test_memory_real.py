"""Oracle: estimated model-state bytes against what real modules and optimizers allocate.

In one process, world size 1 (multi-rank exactness is for the distributed oracles):

- transformers models (Qwen2 with q/k/v biases, tied Llama, Qwen3-MoE with fused
  experts) in fp32 and bf16: ``sum(p.numel() * p.element_size())`` of the parameters,
  of their gradients after one backward pass, and of ``torch.optim.AdamW`` /
  ``SGD(momentum)`` state after one step, against :func:`estimate_memory` of the
  single-rank FSDP2 layout (and :func:`local_param_bytes`).
- FSDP2 over 3 and 4 simulated ranks (``fully_shard`` per decoder layer and at the
  root, over a fake process group, one rank at a time): every rank's local parameter
  bytes and ``AdamW`` state bytes, uneven shards included (vocabulary 61, 6 stacked
  experts over 4 ranks).
- Megatron-Core ``GPTModel`` (dense and MoE, vocabulary padded to 128): parameter bytes
  exactly; the ``DistributedDataParallel`` gradient buffer within Megatron's alignment
  padding (each parameter starts on a multiple of 64 elements, each bucket ends on a
  multiple of 128), which the estimate leaves out.
"""

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.layouts.vocab import padded_vocab_size
from areal_fn.model.spec import model_from_hf_config
from areal_fn.model.tensor_spec import torch_dtype
from areal_fn.plans.memory import Optimizer, PrecisionPolicy, estimate_memory, local_param_bytes
from areal_fn.strategy.allocation import ParallelDims

transformers = pytest.importorskip("transformers")

QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 101,
    "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}
LLAMA_TIED = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 56,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "vocab_size": 77,
    "tie_word_embeddings": True,
    "max_position_embeddings": 64,
}
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "mlp_only_layers": [1],
    "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}
CONFIGS = {"qwen2": QWEN2, "llama_tied": LLAMA_TIED, "qwen3_moe": QWEN3_MOE}


def _hf_model(cfg: dict[str, Any], dtype: str) -> Any:
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **rest)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_bytes(state.values()) for state in opt.state.values())


POLICIES = {
    ("float32", "adam"): PrecisionPolicy.fp32(),
    ("bfloat16", "adam"): PrecisionPolicy.bf16_pure(),
    ("float32", "sgd_momentum"): PrecisionPolicy(
        param_dtype="float32",
        grad_dtype="float32",
        master_weights=False,
        optimizer=Optimizer.SGD_MOMENTUM,
        state_dtype="float32",
    ),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize(("dtype", "optimizer"), sorted(POLICIES))
def test_transformers_model_state_matches_the_estimate(family, dtype, optimizer):
    cfg = {**CONFIGS[family], "torch_dtype": dtype}
    spec = model_from_hf_config(cfg)
    model = _hf_model(cfg, dtype)
    layout = fsdp2_layout(spec, ParallelDims())
    row = estimate_memory(layout, POLICIES[(dtype, optimizer)]).rows[0]

    params = _bytes(model.parameters())
    assert local_param_bytes(layout, 0, dtype) == params
    assert row.params == params

    ids = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert row.grads == _bytes(p.grad for p in model.parameters())

    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    opt.step()
    assert row.optimizer == _state_bytes(opt)


# ------------------------------------------------------------------ FSDP2, several ranks


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_fsdp2_ranks_hold_exactly_the_estimated_state(family, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    cfg = {**CONFIGS[family], "torch_dtype": "float32", "vocab_size": 61}
    if family == "qwen3_moe":
        cfg["num_experts"] = 6
    spec = model_from_hf_config(cfg)
    report = estimate_memory(fsdp2_layout(spec, ParallelDims(dp=world)), PrecisionPolicy.fp32())
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (world,))
            model = _hf_model(cfg, "float32")
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            params = [_local(p) for p in model.parameters()]
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            opt.step()
            state = sum(
                _bytes(_local(v) for v in st.values() if isinstance(v, torch.Tensor))
                for st in opt.state.values()
            )
        finally:
            dist.destroy_process_group()
        row = report.rows[rank]
        assert row.params == _bytes(params), f"rank {rank}"
        assert row.optimizer == state, f"rank {rank}"


# ------------------------------------------------------------------ Megatron-Core

needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="needs megatron-core"
)


@contextlib.contextmanager
def _single_process_group() -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _arch(cfg: dict[str, Any]) -> dict[str, Any]:
    """The Megatron builder's architecture fields for a config dict."""
    spec = model_from_hf_config(cfg)
    return {
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "qkv_bias": spec.qkv_bias,
        "qk_norm": spec.qk_norm,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "num_experts": spec.num_experts or None,
        "moe_intermediate_size": spec.moe_intermediate_size or None,
        "num_experts_per_tok": spec.num_experts_per_tok or None,
        "norm_topk_prob": spec.norm_topk_prob if spec.is_moe else None,
        "moe_layer_pattern": [int(m) for m in spec.moe_layers] if spec.is_moe else None,
    }


@needs_megatron
def test_megatron_parameters_and_grad_buffer_match_the_estimate():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns that Apex / TE are missing
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        from areal_fn.runtime.megatron.build import (
            MegatronSizes,
            build_model_chunks,
            megatron_session,
            transformer_config,
        )
    cases = [QWEN2, {**QWEN3_MOE, "mlp_only_layers": []}, LLAMA_TIED]
    with warnings.catch_warnings(), _single_process_group():
        warnings.simplefilter("ignore")
        for cfg in cases:
            spec = model_from_hf_config({**cfg, "torch_dtype": "float32"})
            layout = megatron_layout(spec, ParallelDims())
            policy = PrecisionPolicy.fp32()
            row = estimate_memory(layout, policy).rows[0]
            arch = _arch(cfg)
            with megatron_session(MegatronSizes()):
                config = transformer_config(arch, MegatronSizes())
                vocab = padded_vocab_size(spec.vocab_size, tp=1)
                chunks = build_model_chunks(arch, config, vocab_size=vocab)
                params = list(chunks[0].parameters())
                assert local_param_bytes(layout, 0, "float32") == _bytes(params)
                assert row.params == _bytes(params)
                ddp = DistributedDataParallel(
                    config,
                    DistributedDataParallelConfig(
                        grad_reduce_in_fp32=True, use_distributed_optimizer=True
                    ),
                    chunks[0],
                )
                grad_buffer = sum(_bytes([b.grad_data]) for b in ddp.buffers)
                slack = 4 * (64 * len(params) + 128 * len(ddp.buffers))
                assert row.grads <= grad_buffer <= row.grads + slack, cfg["model_type"]
