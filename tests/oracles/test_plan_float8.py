"""``areal-fn plan --float8-recipe``: what it counts against what torchao's float8
training holds and creates in ``Fsdp2Engine`` on ``fsdp:d1`` (one gloo rank here).

- the layers counted (:func:`float8_linears`) are the ``nn.Linear`` layers transformers
  builds (every family, a drawn tiny config each) and those torchao converts;
- parameters, gradients and AdamW states after one step equal the plan's per-rank bytes
  (plain fp32);
- the FP8 tensors created during the step, seen through torch's dispatcher: the most
  bytes alive at once equal the plan's ``buffers`` (weight, input and gradient copies
  over the step's tokens), the weight-shaped ones alone its weight copy, and none is
  left after the step.

The refusals of ``--float8-recipe`` are in ``tests/invalid/test_plan_flags.py``.
"""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_fn.cli import main
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.memory import FLOAT8_RECIPES, float8_linears
from areal_fn.plans.memory.float8 import _linear_weights
from areal_fn.runtime.engines.fsdp2 import build_hf_model
from areal_fn.runtime.engines.fsdp2_apply import Fsdp2RunOptions
from areal_fn.testing.models import FAMILY_NAMES, hf_configs
from tests.created_util import Created, fsdp2_step_state

pytest.importorskip("torchao")

_F8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_IDS = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert main(["plan", "demo", "fsdp:d1", *argv, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["components"][0]["memory"]
    return memory  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", FAMILY_NAMES)
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_linear_layers_counted_are_those_transformers_builds(
    family: str, data: st.DataObject
) -> None:
    spec = model_from_hf_config(data.draw(hf_configs(family)))
    model = build_hf_model(spec)
    built = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head"
    }
    assert {t.name for t in _linear_weights(spec)} == built


def test_the_layers_counted_are_those_torchao_converts() -> None:
    from torchao.float8.float8_linear import Float8Linear

    from areal_fn.runtime.engines.fp8_training import convert_to_float8

    cfg = {**DEMO_CONFIG, "intermediate_size": 120}  # gate/up/down not multiples of 16
    spec = model_from_hf_config(cfg)
    model = build_hf_model(spec)
    convert_to_float8(model, "tensorwise")
    converted = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {t.name for t in float8_linears(spec)}
    assert len(converted) == 4 * 4  # q, k, v, o in each of 4 layers


@pytest.mark.parametrize("recipe", FLOAT8_RECIPES)
def test_plan_counts_what_float8_training_holds_and_creates(
    capsys: pytest.CaptureFixture[str], recipe: str
) -> None:
    spec = model_from_hf_config(DEMO_CONFIG)
    weights = {tuple(t.shape) for t in spec.tensors if len(t.shape) == 2}
    weights |= {s[::-1] for s in weights}
    fp8 = Created(lambda t: t.dtype in _F8)
    fp8_weights = Created(lambda t: t.dtype in _F8 and tuple(t.shape) in weights)
    run = Fsdp2RunOptions(float8_recipe=recipe)
    state = fsdp2_step_state(spec, _IDS, [fp8, fp8_weights], run_options=run)
    assert fp8.seen and not fp8.live  # FP8 copies were made, none outlives the step

    tokens = _plan(capsys, "--float8-recipe", recipe, "--seq-len", str(_IDS.shape[1]))
    (row,) = tokens["per_rank"]
    assert (row["params"], row["grads"], row["optimizer"]) == state
    assert tokens["precision"]["name"] == "fp32"
    f8 = tokens["float8"]
    assert (f8["recipe"], f8["tokens"], f8["linears"]) == (recipe, 8, 28)
    assert row["buffers"] == f8["buffer_bytes"] == fp8.peak
    assert f8["weight_bytes"] == fp8_weights.peak
    (weights_only,) = _plan(capsys, "--float8-recipe", recipe)["per_rank"]
    assert weights_only["buffers"] == fp8_weights.peak
    assert (weights_only["params"], weights_only["grads"], weights_only["optimizer"]) == state
