"""The areal-fn command: plan (tables, pictures, suggestions) and its errors."""

import pytest
from PIL import Image

from areal_fn.cli import main


def read_png(path):
    """A PNG's (width, height), read by PIL after it verifies the file."""
    with Image.open(path) as im:
        im.verify()
        assert im.format == "PNG"
        return im.size


def test_plan_prints_memory_pipeline_and_pictures(tmp_path, capsys):
    assert (
        main(
            [
                "plan",
                "Qwen2.5-7B",
                "sglang:d2t4+megatron:d2p2t2",
                "--tensors",
                "3",
                "--png",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "MemoryReport megatron, 8 ranks" in out and "pipeline: Et*14|t*14L" in out
    assert "tp_kv:S(0)" in out or "tp_kv" in out
    w, h = read_png(tmp_path / "megatron-d2p2t2.ranks.png")
    assert 600 <= w <= 1700 and 250 <= h <= 1200  # a figure, not 1 pixel per rank
    read_png(tmp_path / "megatron-d2p2t2.stages.png")
    read_png(tmp_path / "sglang-d2t4.ranks.png")


def test_plan_suggests_expert_parallelism_for_moe(capsys):
    assert (
        main(["plan", "Qwen3-30B-A3B", "--suggest", "16", "--device-memory", "80GB", "--top", "3"])
        == 0
    )
    out = capsys.readouterr().out
    assert "1. megatron:" in out and "e" in out.split("1. megatron:")[1].split(":")[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "Qwen2.5-7B"], "plan needs an ALLOCATION"),
        (["plan", "Qwen2.5-7B", "--suggest", "8"], "--suggest needs --device-memory"),
        (
            ["plan", "Qwen2.5-7B", "--suggest", "8", "--device-memory", "lots"],
            "--device-memory 'lots' is not a size",
        ),
        (["plan", "Qwen2.5-7B", "megatron:d1t3"], "tp=3 does not divide num_attention_heads=28"),
        (["plan", "no/such/config.json", "fsdp:d2"], "error"),
        (["convert", "/no/such/dir", "megatron:t2", "/tmp/x"], "error"),
    ],
)
def test_bad_input_is_a_short_error(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal-fn: error:") and message in err and "Traceback" not in err


def test_checkpoint_inspect_and_export(tmp_path, capsys):
    import torch
    import transformers

    from areal_fn import ParallelDims, fsdp2_layout, model_from_hf_config, to_megatron
    from areal_fn.model.demo import DEMO_CONFIG
    from areal_fn.runtime.checkpoint.api import RankState, save_checkpoint

    model = model_from_hf_config(DEMO_CONFIG)
    layout = fsdp2_layout(model, ParallelDims(dp=2, tp=2))
    g = torch.Generator().manual_seed(0)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
    states = {r: RankState(params=to_megatron(canon, layout, r)) for r in range(4)}
    save_checkpoint(
        tmp_path / "ck", layout=layout, states=states, model=model, allocation="fsdp:d2t2", step=3
    )
    assert main(["checkpoint", "inspect", str(tmp_path / "ck"), "--verify", "--tensors", "3"]) == 0
    out = capsys.readouterr().out
    assert "fsdp:d2t2" in out and "model.embed_tokens.weight" in out
    assert main(["checkpoint", "export-hf", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    )
    sd = hf.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in canon.items())
