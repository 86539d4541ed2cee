"""Every subcommand prints what the user typed verbatim: rich markup and emoji codes in
names, paths and allocation strings (``[actor]``, ``[bold]``, ``:cat:``) are text, not
styling, and a printed path is one that exists."""

import json
from pathlib import Path

import pytest
import torch

from areal_fn import ParallelDims, fsdp2_layout, model_from_hf_config, to_megatron
from areal_fn.cli import main
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.runtime.checkpoint.api import RankState, save_checkpoint
from areal_fn.runtime.hf.io import write_hf_checkpoint

MODEL = model_from_hf_config(DEMO_CONFIG)


@pytest.fixture(autouse=True)
def _narrow_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # long paths must not be folded either


def _hf(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {t.name: torch.randn(t.shape, generator=g) for t in MODEL.tensors}
    return write_hf_checkpoint(path, tensors, model=MODEL)


def _printed_paths(out: str, prefix: str) -> list[Path]:
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert lines, out
    return [Path(p) for line in lines for p in line[len(prefix) :].split(", ")]


def test_plan_prints_names_allocations_and_picture_paths_verbatim(capsys, tmp_path):
    alloc = "sglang[roll]:d1t2+megatron[actor]:t2p2"
    pics = tmp_path / "pics[bold]:cat:"
    assert main(["plan", "demo", alloc, "--tensors", "2", "--png", str(pics)]) == 0
    out = capsys.readouterr().out
    assert "allocation sglang[roll]:d1t2+megatron[actor]:d1p2t2 on 6 ranks" in out, out
    assert "sglang[roll] sglang[roll]:d1t2 ranks 0..1" in out, out
    assert "megatron[actor] megatron[actor]:d1p2t2 ranks 2..5" in out, out
    assert "sglang[roll]: weights per rank" in out and "megatron[actor]: placements" in out, out
    paths = _printed_paths(out, "pictures: ")
    assert len(paths) == 3 and all(p.exists() for p in paths), (paths, sorted(pics.iterdir()))


def test_plan_suggest_reads_a_bracketed_config_path(capsys, tmp_path):
    cfg = tmp_path / "cfg[bold]"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(DEMO_CONFIG))
    assert main(["plan", str(cfg), "--suggest", "4", "--device-memory", "1GB", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "strategies for qwen2 (197,952 parameters) on 4 devices of 1GB" in out, out


def test_convert_and_back_print_paths_verbatim(capsys, tmp_path):
    src = _hf(tmp_path / "hf[red]:cat:")
    local = tmp_path / "out[bold]x"
    assert main(["convert", str(src), "megatron:t2p2", str(local)]) == 0
    out = capsys.readouterr().out
    assert f"-> {local}" in out and local.is_dir(), out
    back = tmp_path / "back[/]"
    assert main(["convert", str(local), "megatron:t2p2", str(back), "--to-hf"]) == 0
    out = capsys.readouterr().out
    assert f"-> {back}" in out and back.is_dir(), out


def test_checkpoint_inspect_and_export_print_paths_verbatim(capsys, tmp_path):
    layout = fsdp2_layout(MODEL, ParallelDims(dp=2, tp=2))
    canon = {t.name: torch.zeros(t.shape) for t in MODEL.tensors}
    states = {r: RankState(params=to_megatron(canon, layout, r)) for r in range(4)}
    root = tmp_path / "ck[bold]:cat:"
    save_checkpoint(root, layout=layout, states=states, model=MODEL, allocation="fsdp:d2t2", step=1)
    assert main(["checkpoint", "inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"in {root}:" in out, out
    dest = tmp_path / "hf[i]"
    assert main(["checkpoint", "export-hf", str(root), str(dest)]) == 0
    assert str(dest) in capsys.readouterr().out and dest.is_dir()


@pytest.mark.parametrize(
    ("argv", "quoted"),
    [
        (["plan", "no[bold]such:cat:", "fsdp:d2"], "no[bold]such:cat:"),
        (["plan", "demo", "megatron[actor:t2"], "megatron[actor:t2"),
        (["plan", "demo", "--suggest", "4", "--device-memory", "[b]80GB"], "'[b]80GB'"),
    ],
)
def test_errors_quote_the_input_verbatim(argv, quoted, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal-fn: error:") and quoted in err, err
