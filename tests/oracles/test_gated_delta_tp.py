"""A gated delta net split by key-head group is exact: transformers' own module, run on
each ``tp`` rank's part (in float64, one process), summed over the ranks, equals the
whole module, and the sum of the ranks' gradients equals the whole module's, to the
rounding of float32: transformers' gated norm and decay ``g`` compute in float32
whatever the input's dtype (measured: at most 1.1e-7 of the largest value, 1.8e-8 of a
``dt_bias`` gradient of 0.16, one float32 ulp; a wrong row would be off by the values'
own size).

Each rank's part is cut here from head counts alone (not by the code under test): key
heads ``r*k .. (r+1)*k``; Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` by key-head
group (each group's rows contiguous), ``[q; k; v]`` (``conv1d``, Qwen3.5's
``in_proj_qkv``) as three ranges, ``in_proj_z/b/a``, ``A_log``, ``dt_bias`` by value head,
``out_proj`` by input column, ``norm`` whole. Then :func:`~areal_fn.model.linear_tp.delta_qkv_rows`
against the same ranges. The FSDP2 engine's law under ``tp`` (``grad_worker.py``'s
``fsdp:d2t2`` cases) runs the same split through DTensor.
"""

import copy
import importlib.util

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs transformers", allow_module_level=True)

import torch
from torch import nn

from areal_fn.model.linear_tp import delta_local_heads, delta_qkv_rows
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.engines.fsdp2 import build_hf_model
from tests.distributed import gated_delta_configs
from tests.distributed.gated_delta_configs import rank_parts

#: key heads 4, value heads 8: tp 2 and 4 split them
CONFIG = {"linear_num_key_heads": 4, "linear_num_value_heads": 8, "num_hidden_layers": 1}
CONFIG["layer_types"] = ["linear_attention"]
MODELS = {
    "qwen3_next": {**gated_delta_configs.qwen3_next(), **CONFIG, "mlp_only_layers": []},
    "qwen3_5_text": {**gated_delta_configs.qwen3_5_text(), **CONFIG},
}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to a few float32 ulps of the largest value."""
    return float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())


def _rank_module(whole: nn.Module, cfg: dict[str, object], tp: int, r: int) -> nn.Module:
    part = copy.deepcopy(whole)
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])  # type: ignore[call-overload]
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])  # type: ignore[call-overload]
    cut = rank_parts(cfg, tp, r)
    for name, p in whole.named_parameters():
        owner, _, attr = name.rpartition(".")
        mod = part.get_submodule(owner)
        sel = cut.get(name)
        if sel is None:  # norm: whole
            continue
        idx = torch.tensor(list(range(*sel)) if isinstance(sel, tuple) else sel)
        dim = 1 if name == "out_proj.weight" else 0
        mod._parameters[attr] = nn.Parameter(p.detach().index_select(dim, idx).clone())
    k, v = nk // tp, nv // tp
    part.num_k_heads, part.num_v_heads = k, v
    part.key_dim, part.value_dim = k * dk, v * dv
    return part


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_key_head_groups_summed_equal_the_whole_module(name: str, tp: int) -> None:
    cfg = MODELS[name]
    spec = model_from_hf_config(cfg)
    model = build_hf_model(spec, seed=7).double()
    whole = model.get_submodule("model.layers.0.linear_attn")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    x = torch.randn(2, 11, spec.hidden_size, generator=gen, dtype=torch.float64)
    x_whole = x.clone().requires_grad_(True)
    out = whole(x_whole)
    out.square().sum().backward()
    x_parts = x.clone().requires_grad_(True)
    parts = [_rank_module(whole, cfg, tp, r) for r in range(tp)]
    total = sum(p(x_parts) for p in parts)
    assert isinstance(total, torch.Tensor)
    total.square().sum().backward()
    assert _close(total.detach(), out.detach())
    assert x_whole.grad is not None and x_parts.grad is not None
    assert _close(x_parts.grad, x_whole.grad)
    grads = {n: p.grad for n, p in whole.named_parameters()}
    norm_sum = sum(dict(p.named_parameters())["norm.weight"].grad for p in parts)
    assert isinstance(norm_sum, torch.Tensor) and grads["norm.weight"] is not None
    assert _close(norm_sum, grads["norm.weight"])
    for r, part in enumerate(parts):
        sel = rank_parts(cfg, tp, r)
        for n, p in part.named_parameters():
            if n not in sel or n not in grads:
                continue
            s = sel[n]
            idx = torch.tensor(list(range(*s)) if isinstance(s, tuple) else s)
            want = grads[n].index_select(1 if n == "out_proj.weight" else 0, idx)
            assert _close(p.grad, want), n


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_rows_are_each_ranks_queries_keys_values(tp: int) -> None:
    cfg = MODELS["qwen3_5_text"]
    la = model_from_hf_config(cfg).linear_attention
    assert la is not None
    assert delta_local_heads(la, tp) == (4 // tp, 8 // tp)
    for r in range(tp):
        ranges = delta_qkv_rows(la, tp, r)
        assert [i for a, b in ranges for i in range(a, b)] == rank_parts(cfg, tp, r)[
            "conv1d.weight"
        ]


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe_text"])
def test_tp_plan_gives_each_linear_attention_module_one_style(name: str) -> None:
    from areal_fn.layouts.fsdp2 import fsdp2_layout
    from areal_fn.runtime.engines.delta_tp import GatedDeltaNetParallel
    from areal_fn.runtime.engines.tp_styles import tp_plan

    spec = model_from_hf_config(getattr(gated_delta_configs, name)())
    plan = tp_plan(build_hf_model(spec, seed=0), fsdp2_layout(spec, "fsdp:d2t2"))
    la = spec.linear_attention
    assert la is not None
    for i, linear in enumerate(la.layers):
        mixer = f"model.layers.{i}.linear_attn"
        style = plan.get(mixer)
        assert isinstance(style, GatedDeltaNetParallel) == linear, mixer
        assert not any(n.startswith(mixer + ".") for n in plan), mixer  # children: its style
        if isinstance(style, GatedDeltaNetParallel):
            rows = {"conv1d.weight"} | ({"in_proj_qkv.weight"} if "3_5" in name else set())
            assert style.qkv_rows == rows
            assert str(style.placements["A_log"]) == "S(0)"
            assert str(style.placements["out_proj.weight"]) == "S(1)"
            assert str(style.placements["norm.weight"]) == "R"
