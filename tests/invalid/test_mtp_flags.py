"""Multi-token-prediction layers on the command line and in the HF readers: ``--mtp``
carries them into inference and megatron rank files and back (megatron refusing MTP
copies of the embedding and head that differ from the main ones), ``--drop-mtp`` leaves them out (listed
as not carried), and every misuse is one line in the flags' words."""

import json
from pathlib import Path

import pytest
import torch

from areal_fn.cli import main
from areal_fn.errors import ConversionError
from areal_fn.layouts.layout_for import layout_for
from areal_fn.model.spec import model_from_hf_config
from areal_fn.plans.convert import to_megatron
from areal_fn.runtime.hf.convert import convert_to_local, read_local
from areal_fn.runtime.hf.io import HfCheckpoint, write_hf_checkpoint
from tests.laws.test_mtp import TINY

SPEC = model_from_hf_config(TINY, mtp=True)
MAIN = model_from_hf_config(TINY)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    canon = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in SPEC.tensors}
    path = write_hf_checkpoint(tmp_path_factory.mktemp("mtp") / "hf", canon, model=SPEC)
    return path, canon


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()  # a progress bar removed leaves a blank line
    assert err.startswith("areal-fn: error: ") and "Traceback" not in err
    assert "\n" not in err, err
    return err


def test_a_checkpoint_with_mtp_layers_is_refused_with_both_remedies(ckpt, tmp_path, capsys):
    err = _err(capsys, ["convert", str(ckpt[0]), "megatron:t2", str(tmp_path / "out")])
    assert "layers ['2'] are beyond num_hidden_layers" in err
    assert "read the model with --mtp to hold them" in err and "with --drop-mtp" in err
    assert not (tmp_path / "out").exists()


def test_drop_mtp_converts_the_main_model_and_lists_what_it_left_out(ckpt, tmp_path, capsys):
    path, canon = ckpt
    out = tmp_path / "out"
    argv = ["convert", str(path), "megatron:t2", str(out), "--drop-mtp", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (
        "model.layers.2.* (a multi-token-prediction layer, left out as asked)"
        in (doc["not_carried"])
    )
    layout = layout_for(MAIN, "megatron:t2")
    main_only = {n: t for n, t in canon.items() if n in MAIN.tensor_names}
    for r in range(layout.world_size):
        got = read_local(out / f"rank{r:05d}.safetensors")
        want = to_megatron(main_only, layout, r)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_mtp_carries_them_into_inference_rank_files_and_back(ckpt, tmp_path, capsys):
    path, canon = ckpt
    ranks, back = tmp_path / "ranks", tmp_path / "back"
    assert main(["convert", str(path), "sglang:t2", str(ranks), "--mtp"]) == 0
    head = read_local(ranks / "rank00001.safetensors")["model.layers.2.shared_head.head.weight"]
    assert head.shape == (32, 8)  # the vocabulary padded to 64 and split over t2
    assert main(["convert", str(ranks), str(back), "--to-hf"]) == 0
    capsys.readouterr()
    with HfCheckpoint(back) as got:
        assert sorted(got.names) == sorted(canon)
        for name, t in canon.items():
            assert torch.equal(got.read_full(name), t), name


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint whose MTP copies of the embedding and head equal the main ones."""
    g = torch.Generator().manual_seed(8)
    canon = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in SPEC.tensors}
    canon["model.layers.2.embed_tokens.weight"] = canon["model.embed_tokens.weight"].clone()
    canon["model.layers.2.shared_head.head.weight"] = canon["lm_head.weight"].clone()
    path = write_hf_checkpoint(tmp_path_factory.mktemp("mtp_tied") / "hf", canon, model=SPEC)
    return path, canon


@pytest.mark.parametrize("alloc", ["megatron:t2", "megatron:d2p2e2"])
def test_mtp_carries_them_into_megatron_rank_files_and_back(tied_ckpt, tmp_path, capsys, alloc):
    path, canon = tied_ckpt
    ranks, back = tmp_path / "ranks", tmp_path / "back"
    assert main(["convert", str(path), alloc, str(ranks), "--mtp"]) == 0
    layout = layout_for(SPEC, alloc)
    for r in range(layout.world_size):
        got = read_local(ranks / f"rank{r:05d}.safetensors")
        want = to_megatron(canon, layout, r)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert any(n.startswith("mtp.layers.0.") for n in got)  # the last rank: the MTP block
    assert main(["convert", str(ranks), str(back), "--to-hf"]) == 0
    capsys.readouterr()
    with HfCheckpoint(back) as hf:
        assert sorted(hf.names) == sorted(canon)
        for name, t in canon.items():
            assert torch.equal(hf.read_full(name), t), name


def test_megatron_refuses_mtp_copies_that_differ_from_the_main_tensors(ckpt, tmp_path, capsys):
    err = _err(capsys, ["convert", str(ckpt[0]), "megatron:t2", str(tmp_path / "out"), "--mtp"])
    assert "model.layers.2.embed_tokens.weight" in err and "must be equal" in err
    assert "(--drop-mtp)" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sglang:t2", "OUT", "--mtp", "--drop-mtp"], "pass one of them"),
        (["OUT", "--to-hf", "--mtp"], "--mtp and --drop-mtp apply to reading an HF checkpoint"),
        (["megatron:t2", "OUT", "--format", "torch_dist", "--mtp"], "pass --drop-mtp"),
        (["fsdp:d2", "OUT", "--mtp"], "build the model without them (leave out --mtp)"),
    ],
)
def test_misuse_of_the_flags_is_one_line(ckpt, tmp_path, capsys, argv, message):
    argv = [str(tmp_path / a) if a == "OUT" else a for a in argv]
    assert message in _err(capsys, ["convert", str(ckpt[0]), *argv])
    assert not (tmp_path / "OUT").exists()


def test_plan_says_what_mtp_does_for_each_component(capsys):
    assert main(["plan", "DeepSeek-V3", "sglang:t8p2", "--mtp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["mtp_layers"] == 1 and doc["model"]["num_params"] == 684_489_845_504
    err = _err(capsys, ["plan", "DeepSeek-V3", "fsdp:d8t8", "--mtp"])
    assert "fsdp (fsdp:d8t8) cannot hold this deepseek_v3 model" in err
    assert "(leave out --mtp)" in err
    err = _err(capsys, ["plan", "Qwen3-8B", "sglang:t2", "--mtp"])
    assert "--mtp: Qwen3-8B (qwen3) declares no multi-token-prediction layers" in err


def test_drop_mtp_in_the_library_names_what_it_leaves_out(ckpt, tmp_path):
    path, _ = ckpt
    with HfCheckpoint(path) as c:
        dropped = c.check(MAIN, drop_mtp=True)
        assert dropped and all(n.startswith("model.layers.2.") for n in dropped)
        assert set(dropped) == set(SPEC.tensor_names) - set(MAIN.tensor_names)
        assert c.check(SPEC, drop_mtp=True) == ()  # a model holding them reads them all
        qwen = model_from_hf_config("Qwen3-8B")
        with pytest.raises(ConversionError, match=r"drop_mtp=True: qwen3 has no multi-token"):
            c.check(qwen, drop_mtp=True)
    with pytest.raises(ConversionError, match=r"unexpected"):
        convert_to_local(path, "megatron:t2", tmp_path / "x")
