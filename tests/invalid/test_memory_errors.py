"""One table of bad inputs to memory estimates, censuses and the advisor, with their messages."""

import functools
from pathlib import Path

import pytest

from areal_fn.errors import LayoutError, PlanError, SpecError
from areal_fn.layouts.inference import inference_layout
from areal_fn.layouts.megatron import megatron_layout
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.advisor import Hardware, suggest_strategy
from areal_fn.plans.advisor.census import Census, TensorGroup, fsdp2_census, megatron_census
from areal_fn.plans.advisor.score import ep_token_copies
from areal_fn.plans.memory import (
    GIB,
    ActivationModel,
    PrecisionPolicy,
    RankMemory,
    estimate_memory,
    estimate_rows,
    float8_copies,
    local_param_bytes,
    with_float8,
)
from areal_fn.sharding.mesh import Mesh
from areal_fn.sharding.placement import Replicate, Shard
from areal_fn.sharding.sharding import Sharding
from areal_fn.strategy.allocation import ParallelDims

SPECS = Path(__file__).resolve().parents[2] / "specs" / "models"
ACT = ActivationModel(micro_batch_size=1, seq_len=128)
D4 = ParallelDims(dp=2, tp=2)


@functools.cache
def spec(name: str) -> ModelSpec:
    return model_from_hf_config(SPECS / f"{name}.json")


def small_layout():  # type: ignore[no-untyped-def]
    return megatron_layout(spec("Qwen2.5-0.5B"), D4)


MESH = Mesh.of(dp=2)
CASES = [
    (
        "negative micro-batch",
        lambda: ActivationModel(micro_batch_size=-1, seq_len=128),
        r"ActivationModel.micro_batch_size=-1 must be an int >= 1",
    ),
    (
        "zero sequence length",
        lambda: ActivationModel(micro_batch_size=1, seq_len=0),
        r"ActivationModel.seq_len=0 must be an int >= 1",
    ),
    (
        "recompute not a bool",
        lambda: ActivationModel(micro_batch_size=1, seq_len=8, recompute=1),  # type: ignore[arg-type]
        r"ActivationModel.recompute=1 must be True or False",
    ),
    (
        "unknown optimizer",
        lambda: PrecisionPolicy(optimizer="lion"),
        r"PrecisionPolicy.optimizer='lion' is not a known optimizer; use one of \['adam', "
        r"'adamw', 'sgd', 'sgd_momentum'\]",
    ),
    (
        "integer parameter dtype",
        lambda: PrecisionPolicy(param_dtype="int8"),
        r"dtype 'int8' is not a floating dtype; parameters, gradients and optimizer state use "
        r"one of \['float64', 'float32', 'bfloat16', 'float16'\]",
    ),
    (
        "unknown dtype",
        lambda: PrecisionPolicy(grad_dtype="fp8"),
        r"dtype='fp8' is not a known dtype",
    ),
    (
        "master weights not a bool",
        lambda: PrecisionPolicy(master_weights="yes"),  # type: ignore[arg-type]
        r"PrecisionPolicy.master_weights='yes' must be True or False",
    ),
    (
        "negative bytes in a row",
        lambda: RankMemory(rank=0, params=-1, grads=0, optimizer=0),
        r"RankMemory.params=-1 must be an int >= 0",
    ),
    (
        "activations without model and dims",
        lambda: estimate_memory(small_layout(), activation=ACT),
        r"an activation model needs model= \(the ModelSpec\) and dims= \(the ParallelDims\)",
    ),
    (
        "dims of another world size",
        lambda: estimate_memory(
            small_layout(), activation=ACT, model=spec("Qwen2.5-0.5B"), dims=ParallelDims(dp=8)
        ),
        r"dims=d8 has world size 8 but the megatron layout has 4 ranks; pass the dims the "
        r"layout was built from",
    ),
    (
        "dims of another strategy",
        lambda: estimate_memory(
            small_layout(), activation=ACT, model=spec("Qwen2.5-0.5B"), dims=ParallelDims(dp=4)
        ),
        r"dims=d4 has tp=1 but the megatron layout's Mesh\(pp=1, dp=2, cp=1, tp=2\) has tp=2",
    ),
    (
        "activations of an inference layout",
        lambda: estimate_memory(
            inference_layout(spec("Qwen2.5-0.5B"), D4),
            activation=ACT,
            model=spec("Qwen2.5-0.5B"),
            dims=D4,
        ),
        r"activations of an inference engine \(KV cache, CUDA graphs\) are not modelled; pass "
        r"activation=None",
    ),
    (
        "rank out of range (plain sum)",
        lambda: local_param_bytes(small_layout(), 4, "bfloat16"),
        r"rank=4 is outside this megatron layout of 4 ranks; use 0..3",
    ),
    (
        "rank out of range (rows)",
        lambda: estimate_rows(small_layout(), [5]),
        r"rank=5 is outside this megatron census of 4 ranks; use 0..3",
    ),
    (
        "census group count zero",
        lambda: TensorGroup(
            shape=(4,), sharding=Sharding(mesh=MESH, placements=(Shard(dim=0),)), count=0
        ),
        r"TensorGroup.count=0 must be an int >= 1",
    ),
    (
        "census presence off the mesh",
        lambda: TensorGroup(
            shape=(4,), sharding=Sharding(mesh=MESH, placements=(Replicate(),)), present={"pp": 1}
        ),
        r"presence pp=1 does not fit Mesh\(dp=2\); use an axis of the mesh",
    ),
    (
        "census mesh smaller than the world",
        lambda: Census(
            kind="x",
            world_size=4,
            groups=[TensorGroup(shape=(4,), sharding=Sharding.replicated(MESH))],
        ),
        r"a group's mesh Mesh\(dp=2\) has 2 ranks, the census 4; every mesh must cover the "
        r"whole world",
    ),
    (
        "census of an invalid strategy",
        lambda: megatron_census(spec("Qwen2.5-7B"), ParallelDims(dp=1, tp=3)),
        r"tp=3 does not divide num_attention_heads=28 \(qwen2\); tensor parallelism shards "
        r"whole attention heads; use tp in \{1, 2, 4\}$",
    ),
    (
        "fsdp census with uneven TP rows over 3 shards",
        lambda: fsdp2_census(
            model_from_hf_config(
                {
                    "model_type": "llama",
                    "hidden_size": 8,
                    "intermediate_size": 8,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "vocab_size": 101,
                }
            ),
            ParallelDims(dp=3, tp=2),
        ),
        r"model.embed_tokens.weight: dim 0 of size 101 is not divisible by tp=2, and FSDP2 "
        r"over dp_shard=3 \(> 2\)",
    ),
    (
        "no devices",
        lambda: suggest_strategy(spec("Qwen2.5-0.5B"), 0, 80 * GIB),
        r"suggest_strategy: n_devices=0 must be >= 1",
    ),
    (
        "inference backend",
        lambda: suggest_strategy(spec("Qwen2.5-0.5B"), 8, 80 * GIB, backends=("sglang",)),
        r"backend 'sglang' is not a training backend; use 'fsdp' and/or 'megatron'",
    ),
    (
        "margin of the whole device",
        lambda: suggest_strategy(spec("Qwen2.5-0.5B"), 8, 80 * GIB, memory_margin=1.0),
        r"memory_margin=1.0 must be in \[0, 1\)",
    ),
    (
        "no top",
        lambda: suggest_strategy(spec("Qwen2.5-0.5B"), 8, 80 * GIB, top=0),
        r"suggest_strategy: top=0 must be >= 1",
    ),
    (
        "bandwidth not positive",
        lambda: Hardware(inter_node_bandwidth=0.0),
        r"Hardware.inter_node_bandwidth=0.0 must be a finite number > 0",
    ),
    (
        "unknown EP dispatcher",
        lambda: Hardware(ep_dispatch="flex"),
        r"Hardware.ep_dispatch='flex' is not a token dispatcher the score models; use one of "
        r"'alltoall', 'deepep'",
    ),
    (
        "EP copies: experts not even on the ranks",
        lambda: ep_token_copies(experts=12, k=2, ep=8, per_node=8, dispatch="alltoall"),
        r"ep_token_copies: ep=8 and groups=1 must divide experts=12 \(experts lie evenly on "
        r"the ranks and in the groups\); use divisors of 12",
    ),
    (
        "EP copies: more picks than the kept groups hold",
        lambda: ep_token_copies(
            experts=16, k=5, ep=4, per_node=2, dispatch="deepep", groups=4, group_topk=1
        ),
        r"ep_token_copies: k=5 experts do not fit in the top group_topk=1 of groups=4 groups "
        r"of 4; use group_topk <= groups and k <= 4 \* group_topk",
    ),
    (
        "EP copies: a count of zero",
        lambda: ep_token_copies(experts=16, k=0, ep=4, per_node=2, dispatch="deepep"),
        r"ep_token_copies: k=0: every count must be >= 1",
    ),
    (
        "EP copies: more ranks per node than in the group",
        lambda: ep_token_copies(experts=16, k=2, ep=4, per_node=8, dispatch="deepep"),
        r"ep_token_copies: per_node=8 exceeds ep=4; use per_node <= ep",
    ),
    (
        "EP copies: unknown dispatcher",
        lambda: ep_token_copies(experts=16, k=2, ep=4, per_node=2, dispatch="flex"),
        r"ep_token_copies: dispatch='flex' is not a dispatcher; use one of \('alltoall', "
        r"'deepep'\)",
    ),
    (
        "float8 recipe torchao lacks",
        lambda: float8_copies(spec("Qwen2.5-0.5B"), "blockwise"),
        r"^float8 recipe 'blockwise' is not one of torchao's; use one of \('tensorwise', "
        r"'rowwise', 'rowwise_with_gw_hp'\)$",
    ),
    (
        "float8 negative tokens",
        lambda: float8_copies(spec("Qwen2.5-0.5B"), "rowwise", tokens=-1),
        r"^float8_copies: tokens=-1 must be >= 0 \(0: weight copies only\)$",
    ),
    (
        "float8 on a model with no linear layer it converts",
        lambda: float8_copies(
            model_from_hf_config({**DEMO_CONFIG, "hidden_size": 40, "intermediate_size": 72}),
            "tensorwise",
        ),
        r"^float8 recipe 'tensorwise': qwen2 has no linear layer float8 training converts \(every "
        r"nn.Linear but lm_head whose sizes are multiples of 16\); drop it$",
    ),
    (
        "float8 copies added to a megatron report",
        lambda: with_float8(
            estimate_memory(small_layout()), float8_copies(spec("Qwen2.5-0.5B"), "rowwise")
        ),
        r"^with_float8: float8 training runs in the FSDP2 engine, not in a megatron layout; "
        r"pass the report of an fsdp2 layout$",
    ),
    (
        "nothing fits",
        lambda: suggest_strategy(spec("Llama-3.1-70B"), 8, 80 * GIB),
        r"no strategy for this llama model \(70.6B params\) on 8 devices of 80.0 GiB fits: "
        r"tried 26 \(fsdp 4, megatron 22\); the smallest peak is 132.6 GiB \(fsdp:d1t8\); "
        r".*; use more devices, a lighter policy \(PrecisionPolicy.bf16_pure\(\)\), "
        r"optimizer_offload=True or LoRA \(lora=LoraConfig\(...\)\)$",
    ),
]


@pytest.mark.parametrize(("what", "call", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(what, call, message):
    with pytest.raises(SpecError, match=message):
        call()


def test_error_types_callers_catch():
    with pytest.raises(PlanError):
        suggest_strategy(spec("Llama-3.1-70B"), 8, 80 * GIB)
    with pytest.raises(LayoutError):
        megatron_census(spec("Qwen2.5-7B"), ParallelDims(dp=1, tp=3))
