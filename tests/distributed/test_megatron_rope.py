"""Megatron-Core applies Llama 3's rope scaling as transformers does; other rope scaling is refused.

One ``torchrun --nproc-per-node 1`` launch (``rope_worker.py``): a tiny Llama with
Llama 3.1's rope scaling gives the same log-probs under
:class:`~areal_fn.runtime.engines.megatron.MegatronEngine` as the transformers model
(which the FSDP2 engine builds); without the scaling transformers differs clearly, so
the comparison can tell. A yarn config is refused by the engine. Without a launch:
what ``rope_kwargs`` gives GPTModel for the published configs, and its refusals.
"""

import importlib.util
import json
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs megatron-core and transformers", allow_module_level=True)

from areal_fn.runtime.launch import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = Path(__file__).with_name("rope_worker.py")
REPO = Path(__file__).resolve().parents[2]


def test_megatron_engine_applies_llama3_rope_scaling(tmp_path: Path) -> None:
    out = tmp_path / "rope.json"
    run_torchrun(WORKER, ["--out", str(out)], nproc=1, timeout_s=300, cwd=REPO)
    rec = json.loads(out.read_text())
    assert rec["hf_scaled_vs_plain"] > 1e-3, rec  # the scaling changes these log-probs
    assert rec["megatron_vs_hf"] < 1e-5, rec
    assert rec["megatron_vs_plain"] > 1e-3, rec  # Megatron applies it (it used not to)
    assert "(rope_type='yarn') is not applied by Megatron-Core's GPTModel" in rec["yarn_refused"]


# -- no launch ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Llama-3.2-1B", "Qwen2.5-7B", "Qwen3-8B"])
def test_published_rope_scaling_is_what_gpt_model_is_given(name: str) -> None:
    import attrs

    from areal_fn.model.spec import model_from_hf_config
    from areal_fn.runtime.megatron.build import rope_kwargs

    spec = model_from_hf_config(REPO / "specs" / "models" / f"{name}.json")
    factor = dict(spec.rope_scaling).get("factor")
    want = (
        {"rope_scaling": True, "rope_scaling_factor": factor} if factor else {"rope_scaling": False}
    )
    assert rope_kwargs(attrs.asdict(spec)) == want


@pytest.mark.parametrize(
    ("rope_scaling", "message"),
    [
        (
            {"rope_type": "yarn", "factor": 4.0},
            r"rope scaling \{'rope_type': 'yarn', 'factor': 4.0\} \(rope_type='yarn'\) is not "
            r"applied by Megatron-Core's GPTModel, which applies rope_type 'llama3' only \(and "
            r"yarn for gpt_oss\), so it "
            r"would compute other rotations than the config asks for; train this model with the "
            r"fsdp backend, or use a model without rope scaling",
        ),
        (
            [["rope_type", "llama3"], ["factor", 8.0], ["low_freq_factor", 2.0]],
            r"llama3 rope scaling \{.*\} has low_freq_factor=2.0, high_freq_factor=None, "
            r"original_max_position_embeddings=None; Megatron-Core's GPTModel applies llama3 "
            r"scaling with a factor > 0 and \{'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
            r"'original_max_position_embeddings': 8192\} fixed, so it would compute other "
            r"rotations; train this model with the fsdp backend",
        ),
        (
            {"rope_type": "default", "partial_rotary_factor": 0.5},
            r"rope scaling \{'rope_type': 'default', 'partial_rotary_factor': 0.5\} has "
            r"partial_rotary_factor=0.5; the Megatron builder rotates every head dim "
            r"\(rotary_percent=1.0\); use a config without it",
        ),
    ],
)
def test_rope_scaling_gpt_model_cannot_apply_is_refused(rope_scaling: object, message: str) -> None:
    from areal_fn.errors import LayoutError
    from areal_fn.runtime.megatron.build import rope_kwargs

    with pytest.raises(LayoutError, match=message):
        rope_kwargs({"rope_scaling": rope_scaling})
