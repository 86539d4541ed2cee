"""LoRA into a real vLLM (TP2, CPU, fp32), against transformers + PEFT.

Two engines, each in a process of its own (``lora_worker.py``, vLLM's Python):

- a vLLM with ``enable_lora``: ``VllmLoraSync`` serves adapter version 1, then 2;
  after each, vLLM's greedy log-probs with the adapter equal those of a PEFT model (the
  same base, the same adapter, built with PEFT's own ``get_peft_model`` and
  ``set_peft_model_state_dict``) within ``LOGPROB_TOL``, a prompt longer than a
  prefix-cache block included (one directory rewritten in place for both versions gave
  version 2 log-probs off by 1.1 there: vLLM served blocks cached under version 1's
  key); the bytes written equal the
  adapters' size as PEFT counts its parameters; a version over vLLM's ``max_lora_rank``
  is refused before vLLM sees it, version 2 stays served, and the next version loads;
- the same vLLM serves a LoRA trainer's adapters (``Fsdp2Engine(lora=...)`` after one
  step, ``export_adapters``) with the trainer's own log-probs;
- a vLLM without LoRA: a trainer holding ``merge_lora(base, adapters)`` updates it
  (``VllmWeightSync``); vLLM's log-probs equal the PEFT model's with version 2.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vllm.cases import CASES, write_model
from tests.vllm.conftest import run_module
from tests.vllm.lora_worker import PROMPTS

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("vllm")]

#: vLLM's CPU kernels against transformers' (fp32), as the other vLLM tests
LOGPROB_TOL = 2e-5
#: every linear layer of the decoder layers (vLLM's packed qkv_proj and gate_up_proj)
LORA = {
    "rank": 8,
    "alpha": 16.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def _adapters(work: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(work / f"adapters_v{version}.safetensors"))


def _prepare(work: Path) -> None:
    """The served model, the configuration and two adapter versions (random, B nonzero)."""
    from safetensors.torch import save_file

    from areal_fn.model.lora import LoraConfig, lora_tensors

    config = CASES["qwen2-t2"].config
    write_model(work / "hf", config, seed=3)
    (work / "lora.json").write_text(json.dumps(LORA))
    specs = lora_tensors(CASES["qwen2-t2"].spec, LoraConfig(**LORA))
    for version in (1, 2):
        g = torch.Generator().manual_seed(100 + version)
        save_file(
            {s.name: 0.1 * torch.randn(s.shape, generator=g) for s in specs},
            str(work / f"adapters_v{version}.safetensors"),
        )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm_lora")
    _prepare(root)
    return root


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Any]:
    got = {}
    for phase in ("adapter", "merged"):
        out, log = work / f"{phase}.json", work / f"{phase}.log"
        rc = run_module(
            "tests.vllm.lora_worker",
            ["--phase", phase, "--work", str(work), "--out", str(out)],
            timeout_s=420,
            log=log,
        )
        assert rc == 0 and out.exists(), f"{phase}: exit {rc}\n{log.read_text()[-4000:]}"
        got[phase] = json.loads(out.read_text())
    return got


def _base(work: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        work / "hf", dtype=torch.float32
    ).eval()


def _peft(work: Path, version: int) -> Any:
    """PEFT's model of the base with adapter ``version`` (PEFT's own loading)."""
    import peft

    cfg = peft.LoraConfig(
        r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"]
    )
    model = peft.get_peft_model(_base(work), cfg)
    result = peft.set_peft_model_state_dict(model, _adapters(work, version))
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    return model.eval()


@torch.no_grad()
def _max_gap(model: Any, gen: list[dict[str, list[Any]]]) -> float:
    """The largest gap between vLLM's log-probs of its tokens and ``model``'s."""
    gap = 0.0
    for prompt, g in zip(PROMPTS, gen, strict=True):
        ids = torch.tensor([prompt + g["tokens"]])
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
        for i, (t, lp) in enumerate(zip(g["tokens"], g["logprobs"], strict=True)):
            gap = max(gap, abs(float(logp[len(prompt) - 1 + i, t]) - lp))
    return gap


def test_each_adapter_version_serves_peft_logprobs(work: Path, runs: dict[str, Any]) -> None:
    versions = runs["adapter"]["versions"]
    for v in (1, 2):
        assert _max_gap(_peft(work, v), versions[str(v)]["gen"]) <= LOGPROB_TOL, v
    # the versions differ enough that serving the wrong one would fail the check above
    assert _max_gap(_peft(work, 1), versions["2"]["gen"]) > 1e-2
    assert _max_gap(_base(work), runs["adapter"]["base"]) <= LOGPROB_TOL


def test_a_lora_trainers_adapters_serve_its_logprobs(runs: dict[str, Any]) -> None:
    """Version 5: a LoRA-training engine's exported adapters (one step from PEFT's start)."""
    got = runs["adapter"]["trainer"]
    assert got["gap"] <= LOGPROB_TOL
    assert got["bytes_written"] == got["lower_bound"]


def test_bytes_written_are_the_adapters(work: Path, runs: dict[str, Any]) -> None:
    model = _peft(work, 1)
    peft_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n
    )
    for v in (1, 2):
        got = runs["adapter"]["versions"][str(v)]
        assert got["bytes_written"] == got["lower_bound"] == peft_bytes


def test_the_served_directory_is_a_peft_adapter(work: Path, runs: dict[str, Any]) -> None:
    """Each version's directory replaces the previous one; the last (version 5, the
    trainer's) loads in PEFT as the adapters the trainer exported."""
    import peft
    from safetensors.torch import load_file

    got = runs["adapter"]
    listings = [got["versions"][v]["listing"] for v in ("1", "2")]
    assert [*listings, got["version_4_is_1"]["listing"]] == [["v1"], ["v2"], ["v4"]]
    final = Path(got["trainer"]["path"])
    assert sorted(p.name for p in final.parent.iterdir()) == ["v5"]
    loaded = peft.PeftModel.from_pretrained(_base(work), final)
    state = peft.get_peft_model_state_dict(loaded)
    want = load_file(str(work / "trainer_adapters.safetensors"))
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k], want[k]) for k in want)


def test_a_refused_version_leaves_the_last_one_served(work: Path, runs: dict[str, Any]) -> None:
    got = runs["adapter"]
    assert got["refused"] is not None
    assert "adapter ranks {'down_proj': 16," in got["refused"]
    assert "exceed this vLLM's max_lora_rank=8; start vLLM with" in got["refused"]
    assert got["refused_left"] == ["v2"]
    assert got["after_refused"] == got["versions"]["2"]["gen"]
    assert _max_gap(_peft(work, 1), got["version_4_is_1"]["gen"]) <= LOGPROB_TOL


def test_a_merged_sync_serves_peft_logprobs(work: Path, runs: dict[str, Any]) -> None:
    got = runs["merged"]
    assert got["mode"] == "sharded"
    assert got["bytes_sent"] == got["lower_bound"] > 0
    assert _max_gap(_peft(work, 2), got["gen"]) <= LOGPROB_TOL
