"""One meaning of ``--overwrite`` (``overwrite=True``) for every writer of a directory:
the destination is replaced whole, in one step, so stale files of the same kind (older
shards, rank files of another allocation) never survive beside the new output; a file
the writer does not own is refused by name, one line, exit 2, nothing written."""

import json
import re
from pathlib import Path

import pytest
import torch

from areal_fn.cli import main
from areal_fn.errors import CheckpointError, ConversionError
from areal_fn.model.demo import DEMO_CONFIG
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.checkpoint.megatron import export_megatron_checkpoint
from areal_fn.runtime.hf.convert import convert_to_local, read_local
from areal_fn.runtime.hf.io import write_hf_checkpoint

MODEL = model_from_hf_config(DEMO_CONFIG)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(3)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in MODEL.tensors}
    return write_hf_checkpoint(tmp_path_factory.mktemp("overwrite") / "hf", canon, model=MODEL)


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()  # what earlier commands printed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-fn: error: ") and "Traceback" not in err
    assert "\n" not in err, err
    return err


def _ranks(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("rank"))


def test_rank_files_of_another_allocation_do_not_survive_an_overwrite(hf, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(hf), "megatron:t2p2", str(out)]) == 0
    assert len(_ranks(out)) == 4
    capsys.readouterr()
    assert main(["convert", str(hf), "megatron:t2", str(out), "--overwrite", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == [0, 1]
    assert _ranks(out) == ["rank00000.safetensors", "rank00001.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it


def test_older_shards_do_not_survive_an_overwrite_to_hf(hf, tmp_path, capsys):
    ranks, back = tmp_path / "ranks", tmp_path / "back"
    assert main(["convert", str(hf), "megatron:t2", str(ranks)]) == 0
    back.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (back / name).write_bytes(b"old shard")
    (back / "model.safetensors.index.json").write_text("{}")
    assert main(["convert", str(ranks), str(back), "--to-hf", "--overwrite"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in back.iterdir()) == ["config.json", "model.safetensors"]


def test_to_hf_overwrite_refuses_to_delete_a_file_it_does_not_write(hf, tmp_path, capsys):
    ranks, back = tmp_path / "ranks", tmp_path / "back"
    assert main(["convert", str(hf), "megatron:t2", str(ranks)]) == 0
    back.mkdir()
    (back / "tokenizer.json").write_text("{}")
    (back / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (back / "notes").mkdir()
    before = _tree(back)
    err = _err(capsys, ["convert", str(ranks), str(back), "--to-hf", "--overwrite"])
    assert re.search(
        rf"{back} holds 2 entries the new HF checkpoint would not replace: notes/, "
        rf"tokenizer.json; --overwrite replaces the directory whole and would delete them: "
        rf"move them out of {back}, or choose another directory$",
        err,
    ), err
    assert _tree(back) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "ranks"]


def test_a_file_the_source_carries_is_replaced_not_refused(hf, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for p in hf.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    (src / "tokenizer.json").write_text('{"new": 1}')
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"old": 1}')
    assert main(["convert", str(src), "megatron:t2", str(out), "--overwrite"]) == 0
    assert json.loads((out / "tokenizer.json").read_text()) == {"new": 1}


def test_to_local_overwrite_refuses_a_foreign_file(hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank00003.safetensors").write_bytes(b"old rank")
    (out / "train.log").write_text("keep me")
    err = _err(capsys, ["convert", str(hf), "megatron:t2", str(out), "--overwrite"])
    assert f"{out} holds 1 entry the new rank files would not replace: train.log;" in err
    assert _tree(out) == {"rank00003.safetensors": b"old rank", "train.log": b"keep me"}


def test_an_existing_directory_still_needs_overwrite(hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    err = _err(capsys, ["convert", str(hf), "megatron:t2", str(out)])
    assert err.endswith(f"{out} already exists; pass --overwrite or choose another directory")


def test_one_rank_joins_the_other_ranks_of_the_same_conversion(hf, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(hf), "megatron:t2", str(out), "--rank", "0"]) == 0
    zero = (out / "rank00000.safetensors").read_bytes()
    assert main(["convert", str(hf), "megatron:t2", str(out), "--rank", "1", "--overwrite"]) == 0
    assert _ranks(out) == ["rank00000.safetensors", "rank00001.safetensors"]
    assert (out / "rank00000.safetensors").read_bytes() == zero
    assert main(["convert", str(out), str(tmp_path / "back"), "--to-hf"]) == 0


def test_one_rank_is_refused_beside_rank_files_of_another_allocation(hf, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(hf), "megatron:t2p2", str(out)]) == 0
    before = _tree(out)
    argv = ["convert", str(hf), "megatron:t2", str(out), "--rank", "1", "--overwrite"]
    err = _err(capsys, argv)
    assert re.search(
        rf"{out}/rank00000.safetensors was written by another conversion \(allocation "
        rf"'megatron:d1p2t2', not 'megatron:d1t2'; world_size '4', not '2'\); --rank writes one "
        rf"rank beside the other ranks' files, which must be of the same conversion: convert "
        rf"every rank \(without --rank\) to replace them all, or choose another directory$",
        err,
    ), err
    assert _tree(out) == before


def test_the_library_says_overwrite_true(hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")
    with pytest.raises(ConversionError, match=r"overwrite=True replaces the directory whole"):
        convert_to_local(hf, "megatron:t2", out, overwrite=True)
    with pytest.raises(ConversionError, match=r"1 entry the new HF checkpoint would not replace"):
        write_hf_checkpoint(out, {"w": torch.ones(2)}, overwrite=True)
    with pytest.raises(CheckpointError, match=r"the new torch_dist checkpoint would not replace"):
        export_megatron_checkpoint({}, MODEL, out, overwrite=True)
    assert _tree(out) == {"README.md": b"mine"}
    convert_to_local(hf, "megatron:t2p2", tmp_path / "t2p2")
    with pytest.raises(ConversionError, match=r"convert every rank \(without ranks=\)"):
        convert_to_local(hf, "megatron:t2", tmp_path / "t2p2", ranks=[0], overwrite=True)
    assert len(read_local(tmp_path / "t2p2" / "rank00003.safetensors")) > 0


def test_torch_dist_overwrite_refuses_a_foreign_file(hf, tmp_path, capsys):
    out = tmp_path / "td"
    out.mkdir()
    (out / "common.pt").write_bytes(b"old")
    (out / "run.sh").write_text("mine")
    argv = ["convert", str(hf), "megatron:t2", str(out), "--format", "torch_dist", "--overwrite"]
    err = _err(capsys, argv)
    assert f"{out} holds 1 entry the new torch_dist checkpoint would not replace: run.sh;" in err
    assert _tree(out) == {"common.pt": b"old", "run.sh": b"mine"}


def test_torch_dist_overwrite_replaces_the_flat_layout_and_its_own(hf, tmp_path, capsys):
    out = tmp_path / "td"
    out.mkdir()
    for name in (".metadata", "__0_0.distcp", "common.pt", "metadata.json", "config.json"):
        (out / name).write_bytes(b"old")  # what --format torch_dist wrote before the tracker
    argv = ["convert", str(hf), "megatron:t2", str(out), "--format", "torch_dist", "--overwrite"]
    assert main(argv) == 0
    tracker = "latest_checkpointed_iteration.txt"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", tracker, "release"]
    (out / "release" / "common.pt").write_bytes(b"stale")
    assert main(argv) == 0
    assert (out / "release" / "common.pt").read_bytes() != b"stale"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["td"]


def test_torch_dist_overwrite_refuses_what_megatron_lm_or_a_user_left(hf, tmp_path, capsys):
    out = tmp_path / "td"
    argv = ["convert", str(hf), "megatron:t2", str(out), "--format", "torch_dist", "--overwrite"]
    assert main(argv) == 0
    (out / "release" / "notes.txt").write_text("mine")
    (out / "iter_0000100").mkdir()  # Megatron-LM's training saved there
    (out / "iter_0000100" / "common.pt").write_bytes(b"trained")
    before = _tree(out)
    err = _err(capsys, argv)
    assert err.endswith(
        f"{out} holds 2 entries the new torch_dist checkpoint would not replace: "
        f"iter_0000100/, release/notes.txt; --overwrite replaces the directory whole and would "
        f"delete them: move them out of {out}, or choose another directory"
    ), err
    assert _tree(out) == before
