"""Shared by the checkpoint tests: a tiny model, canonical truth, per-rank local states.

Local states are built by :func:`areal_fn.plans.convert.to_megatron` from random canonical
weights (bfloat16) and synthetic Adam moments (float32), so the tests do not depend on
the FSDP2 / Megatron engines. ``salt`` makes different "steps" hold different values.
"""

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from areal_fn.layouts.layout import Layout
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.spec import ModelSpec, model_from_hf_config
from areal_fn.plans.convert import to_megatron
from areal_fn.runtime.checkpoint.api import RankState
from areal_fn.strategy.parse import parse_allocation

#: qwen2 (q/k/v biases), vocab 250 (Megatron pads it), tied embeddings (Megatron's last
#: pipeline stage holds a copy: replicas to deduplicate), bfloat16 parameters.
CONFIG: dict[str, object] = {
    **DEMO_CONFIG,
    "vocab_size": 250,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def model(**overrides: object) -> ModelSpec:
    return model_from_hf_config({**CONFIG, **overrides})


def layout(spec: ModelSpec, allocation: str) -> Layout:
    return layout_for(spec, parse_allocation(allocation).components[0])


def truth(spec: ModelSpec, salt: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Canonical params (bf16), exp_avg, exp_avg_sq (fp32) and per-tensor step."""
    g = torch.Generator().manual_seed(1234 + salt)
    out: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for t in spec.tensors:
        out["param"][t.name] = torch.randn(t.shape, generator=g).to(torch.bfloat16)
        out["exp_avg"][t.name] = torch.randn(t.shape, generator=g)
        out["exp_avg_sq"][t.name] = torch.rand(t.shape, generator=g)
    return out


def step_value(salt: int) -> float:
    return float(100 + salt)


def rank_state(
    lay: Layout, rank: int, t: Mapping[str, Mapping[str, torch.Tensor]], salt: int
) -> RankState:
    params = to_megatron(t["param"], lay, rank)
    m1 = to_megatron(t["exp_avg"], lay, rank)
    m2 = to_megatron(t["exp_avg_sq"], lay, rank)
    return RankState(
        params=params,
        optim={
            n: {"exp_avg": m1[n], "exp_avg_sq": m2[n], "step": torch.tensor(step_value(salt))}
            for n in params
        },
    )


def blank_state(lay: Layout, rank: int, *, fill: float = float("nan")) -> RankState:
    """Local tensors of ``rank`` filled with ``fill`` (NaN: an unwritten element shows)."""
    params = {
        lt.name: torch.full(lt.shape, fill, dtype=torch.bfloat16) for lt in lay.local_tensors(rank)
    }
    return RankState(
        params=params,
        optim={
            n: {
                "exp_avg": torch.full(p.shape, fill),
                "exp_avg_sq": torch.full(p.shape, fill),
                "step": torch.tensor(-1.0),
            }
            for n, p in params.items()
        },
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (bitwise comparison, NaN-safe)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def state_diff(got: RankState, want: RankState) -> list[str]:
    """Names of tensors (and states) that differ bitwise; empty when equal."""
    out = []
    if set(got.params) != set(want.params):
        return [f"names {sorted(got.params)} != {sorted(want.params)}"]
    for n, w in want.params.items():
        g = got.params[n]
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(bits(g), bits(w)):
            out.append(n)
        for k, wv in want.optim.get(n, {}).items():
            gv = got.optim[n][k]
            if gv.dtype != wv.dtype or not torch.equal(bits(gv), bits(wv)):
                out.append(f"{n}/{k}")
    return out


def tree_digest(folder: "str | os.PathLike[str]") -> dict[str, str]:
    """sha256 and mtime of every file under ``folder`` (to show a directory is untouched)."""
    out = {}
    root = Path(folder)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (
                hashlib.sha256(p.read_bytes()).hexdigest() + f" {st.st_mtime_ns} {st.st_size}"
            )
    return out
