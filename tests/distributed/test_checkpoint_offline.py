"""Checkpoints in one process (no process group): every rank of a layout saved or loaded here.

The offline form of the same code path: conversion tools and these tests use it. Covers
both ways of reading a stored chunk (its raw bytes located in the ``torch.save``
record, and the plain ``torch.load`` fallback), box reads through
:class:`CheckpointReader`, HF export, ``inspect_checkpoint`` and the CLI entry point.
"""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import areal_fn.runtime.checkpoint.dcp as ckpt_dcp  # noqa: E402
from areal_fn.errors import CheckpointError  # noqa: E402
from areal_fn.runtime.checkpoint.api import (  # noqa: E402
    CheckpointReader,
    RankState,
    cmd_checkpoint_inspect,
    export_hf,
    inspect_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from areal_fn.runtime.hf.io import HfCheckpoint  # noqa: E402
from areal_fn.sharding.box import Box  # noqa: E402
from tests.distributed.checkpoint_worker_util import (  # noqa: E402
    bits,
    blank_state,
    layout,
    model,
    rank_state,
    state_diff,
    step_value,
    truth,
)

SPEC = model()
SRC = "fsdp:d2t2"
SALT = 11
TRUTH = truth(SPEC, SALT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("offline") / "root"
    lay = layout(SPEC, SRC)
    save_checkpoint(
        root,
        layout=lay,
        states={r: rank_state(lay, r, TRUTH, SALT) for r in range(lay.world_size)},
        model=SPEC,
        allocation=SRC,
        step=SALT,
        optimizer="adam",
        data_position=[3, 4],
        lr_scheduler={"last_epoch": 11},
    )
    return root


@pytest.mark.parametrize("raw", [True, False], ids=["raw bytes", "torch.load fallback"])
@pytest.mark.parametrize(
    "dst", ["fsdp:d1", "megatron:t2p2", "megatron:d2t2", "fsdp:d4", "megatron:p2v2"]
)
def test_offline_load_is_bitwise(saved, monkeypatch, dst, raw):
    if not raw:
        monkeypatch.setattr(ckpt_dcp, "_raw_offset", lambda *a: None)
    lay = layout(SPEC, dst)
    states = {r: blank_state(lay, r) for r in range(lay.world_size)}
    res = load_checkpoint(saved, layout=lay, states=states, optimizer="adam")
    assert res.step == SALT and res.data_position == [3, 4]
    assert res.lr_scheduler == {"last_epoch": 11} and not res.rng_restored
    for r in range(lay.world_size):
        assert state_diff(states[r], rank_state(lay, r, TRUTH, SALT)) == [], (dst, r)


def test_parameters_only_and_explicit_cast(saved):
    lay = layout(SPEC, "fsdp:d2")
    states = {
        r: RankState(params={n: t.float() for n, t in blank_state(lay, r).params.items()})
        for r in range(2)
    }
    load_checkpoint(saved, layout=lay, states=states, allow_cast=True)
    for r in range(2):
        want = rank_state(lay, r, TRUTH, SALT)
        for n, t in states[r].params.items():
            assert torch.equal(t, want.params[n].float()), n


def test_reader_reads_any_box(saved):
    reader = CheckpointReader(saved)
    name = "model.layers.1.self_attn.q_proj.weight"
    box = Box(ranges=((5, 37), (3, 60)))
    assert torch.equal(bits(reader.read(name, box)), bits(TRUTH["param"][name][box.slices()]))
    assert torch.equal(
        bits(reader.read_state(name, "exp_avg_sq", box)),
        bits(TRUTH["exp_avg_sq"][name][box.slices()]),
    )
    assert reader.read_state(name, "step").item() == 100 + SALT
    assert torch.equal(
        bits(reader.read("model.embed_tokens.weight")),
        bits(TRUTH["param"]["model.embed_tokens.weight"]),
    )


def test_hf_export_holds_the_canonical_tensors(saved, tmp_path):
    out = export_hf(saved, tmp_path / "hf", max_shard_bytes=100_000)
    with HfCheckpoint(out) as hf:
        hf.check(SPEC)
        for n, t in TRUTH["param"].items():
            assert torch.equal(bits(hf.read_full(n)), bits(t)), n
    assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()


def test_inspect_names_strategy_tensors_and_sizes(saved, capsys):
    text = inspect_checkpoint(saved, verify=True, max_tensors=3)
    for part in (
        "step 11, data position [3,4]",
        "saved with allocation fsdp:d2t2 (fsdp2 layout, 4 ranks)",
        "model qwen2: 4 layers, hidden 64, vocab 250",
        "optimizer adam(exp_avg, exp_avg_sq, step)",
        "every checksum verified: blake3",
        "model.embed_tokens.weight",
        "250x64",
        "... 47 more tensors",
        "step-00000011 (latest)",
    ):
        assert part in text, (part, text)
    assert cmd_checkpoint_inspect(argparse.Namespace(dir=str(saved), verify=False, tensors=2)) == 0
    assert "checksums not verified" in capsys.readouterr().out


def test_inspect_counts_the_step_once_per_tensor(saved):
    """Bytes per tensor and per rank: every element of the parameter and both moments,
    and Adam's ``step`` (a scalar) once per tensor, from the tensors that were saved."""
    from areal_fn.runtime.commands.inspect_json import inspect_json

    doc = inspect_json(str(saved), verify=False, max_tensors=None, hmac_key=None)
    step = torch.tensor(step_value(SALT)).element_size()
    want = {
        n: sum(TRUTH[k][n].numel() * TRUTH[k][n].element_size() for k in TRUTH) + step
        for n in TRUTH["param"]
    }
    assert {t["name"]: t["bytes"] for t in doc["tensors"]} == want
    assert sum(doc["bytes_per_rank"].values()) == sum(want.values())
    assert doc["lora"] is None  # a model's checkpoint, not adapters
    text = inspect_checkpoint(saved, verify=False, max_tensors=len(want))
    embed = TRUTH["param"]["model.embed_tokens.weight"]
    per_element = sum(TRUTH[k]["model.embed_tokens.weight"].element_size() for k in TRUTH)
    assert f"{(embed.numel() * per_element + step) / 1024:.1f} KiB" in text


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_inspect_without_verify_notices_a_missing_or_cut_file(saved, tmp_path, capsys, damage):
    import shutil

    from areal_fn.cli import main
    from areal_fn.errors import CheckpointError
    from areal_fn.runtime.checkpoint.api import resolve_checkpoint
    from areal_fn.runtime.commands.inspect_json import inspect_json

    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    folder = resolve_checkpoint(copy)
    victim = sorted(folder.glob("*.distcp"))[1]
    if damage == "missing":
        victim.unlink()
        found = "is listed in the manifest but missing; the checkpoint is incomplete"
    else:
        victim.write_bytes(victim.read_bytes()[:100])
        found = "has 100 bytes, the manifest says"
    rule = f"{victim.name} {found}"
    with pytest.raises(CheckpointError, match=rule):
        inspect_checkpoint(copy)
    with pytest.raises(CheckpointError, match=rule):
        inspect_json(str(copy), verify=False, max_tensors=None, hmac_key=None)
    assert main(["checkpoint", "inspect", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal-fn: error:") and rule in err and "Traceback" not in err


def test_torch_dcp_tools_read_it_as_a_plain_dcp_checkpoint(saved, tmp_path):
    """The storage is standard DCP: torch's own converter yields the canonical tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from areal_fn.runtime.checkpoint.api import resolve_checkpoint

    dcp_to_torch_save(resolve_checkpoint(saved), tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    for n, t in TRUTH["param"].items():
        assert torch.equal(bits(full[n]), bits(t)), n
        assert torch.equal(bits(full[f"optim/{n}/exp_avg"]), bits(TRUTH["exp_avg"][n])), n


def test_megatron_export_then_import_is_bitwise(saved, tmp_path):
    from areal_fn.runtime.checkpoint.api import (
        export_megatron_checkpoint,
        import_megatron_checkpoint,
    )

    out = export_megatron_checkpoint(
        CheckpointReader(saved), SPEC, tmp_path / "mcore", vocab_size_padded=256
    )
    assert json.loads((out / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    with pytest.raises(CheckpointError, match=r"mcore/\.metadata: a Megatron-Core torch_dist"):
        import_megatron_checkpoint(out, SPEC)  # its metadata exists only as a pickle
    back = import_megatron_checkpoint(out, SPEC, trust_pickle=True)  # we wrote it
    assert back.keys() == TRUTH["param"].keys()
    for n, t in TRUTH["param"].items():
        assert torch.equal(bits(back[n]), bits(t)), n


# -- the HF files of the model (config.json, tokenizer, generation config) ----------------


def test_hf_files_are_saved_verified_and_exported_unchanged(tmp_path, capsys):
    """Saved with hf=, export-hf gives back the model directory's config.json (eos list,
    token ids, unknown keys; its very bytes), tokenizer and generation config."""
    from areal_fn.cli import main
    from areal_fn.runtime.checkpoint.api import (
        HfFiles,
        checkpoint_hf_files,
        read_hf_files,
        read_manifest,
    )
    from tests.distributed.checkpoint_worker_util import CONFIG
    from tests.hf_dir_util import NOT_CARRIED, add_hf_extras

    carried = add_hf_extras(tmp_path / "model", CONFIG)
    hf = read_hf_files(tmp_path / "model")
    assert hf.skipped == (
        (".gitattributes", "hidden"),
        ("original", "a directory; only top-level files are carried"),
        ("pytorch_model.bin", "weights; the converted or saved weights replace them"),
    )
    lay = layout(SPEC, "megatron:t2p2")
    root = tmp_path / "root"
    save_checkpoint(
        root,
        layout=lay,
        states={r: rank_state(lay, r, TRUTH, SALT) for r in range(lay.world_size)},
        model=SPEC,
        allocation="megatron:t2p2",
        step=5,
        optimizer="adam",
        hf=hf,
    )
    manifest = read_manifest(root)
    assert manifest.model == json.loads(carried["config.json"])
    assert checkpoint_hf_files(root / "step-00000005", manifest) == HfFiles(
        config=hf.config, files=hf.files
    )
    assert main(["checkpoint", "export-hf", str(root), str(tmp_path / "hf")]) == 0
    assert "hf files (exported unchanged): config.json, README.md, chat_template.jinja" in (
        capsys.readouterr().out
    )
    out = tmp_path / "hf"
    for name, data in carried.items():
        assert (out / name).read_bytes() == data, name
    assert not any((out / n).exists() for n in NOT_CARRIED)
    with HfCheckpoint(out) as ck:
        for n, t in TRUTH["param"].items():
            assert torch.equal(bits(ck.read_full(n)), bits(t)), n
    # loads as before (the hf/ files are checked like every file), and a changed one is refused
    states = {r: blank_state(lay, r) for r in range(lay.world_size)}
    load_checkpoint(root, layout=lay, states=states, optimizer="adam")
    tok = root / "step-00000005" / "hf" / "tokenizer.model"
    tok.write_bytes(bytes(reversed(tok.read_bytes())))
    with pytest.raises(
        CheckpointError, match=r"hf/tokenizer\.model has blake3 .* the file is corrupted"
    ):
        load_checkpoint(root, layout=lay, states=states, optimizer="adam")


def test_hf_files_of_another_model_are_refused(tmp_path):
    from areal_fn.runtime.checkpoint.api import HfFiles
    from tests.distributed.checkpoint_worker_util import CONFIG

    lay = layout(SPEC, "fsdp:d2")
    with pytest.raises(
        CheckpointError,
        match=r"cannot save checkpoint .*step-00000001: hf.config describes another model than "
        r"model= \(rope_theta 500000.0 != 10000.0\); pass the config.json the model was built "
        r"from, e.g. read_hf_files\(<model dir>\)",
    ):
        save_checkpoint(
            tmp_path / "root",
            layout=lay,
            states={r: rank_state(lay, r, TRUTH, SALT) for r in range(2)},
            model=SPEC,
            allocation="fsdp:d2",
            step=1,
            optimizer="adam",
            hf=HfFiles.of_config({**CONFIG, "rope_theta": 500000.0}),
        )
    assert not (tmp_path / "root" / "step-00000001").exists()


def test_without_hf_files_the_export_says_what_it_lacks(saved, tmp_path, capsys):
    text = inspect_checkpoint(saved)
    assert "hf files: none saved; an HF export regenerates config.json from the model spec" in text
    from areal_fn.cli import main

    assert main(["checkpoint", "export-hf", str(saved), str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out
    assert "(keys such as eos_token_id are lost) and has no tokenizer or generation config" in said
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def test_a_shard_that_is_all_padding_gets_its_optimizer_step(tmp_path):
    """vocab 40 under megatron:t2 pads the embedding to 256 rows: TP rank 1's shard holds
    padding only, so no read of its own carries Adam's step; it is read from the
    canonical tensor the embedding holds on rank 0."""
    spec = model(vocab_size=40)
    truth_small = truth(spec, SALT)
    src = layout(spec, "fsdp:d1")
    save_checkpoint(
        tmp_path / "root",
        layout=src,
        states={0: rank_state(src, 0, truth_small, SALT)},
        model=spec,
        allocation="fsdp:d1",
        step=SALT,
        optimizer="adam",
    )
    dst = layout(spec, "megatron:t2")
    states = {r: blank_state(dst, r) for r in range(dst.world_size)}
    load_checkpoint(tmp_path / "root", layout=dst, states=states, optimizer="adam")
    padded = [
        (r, lt.name)
        for r in range(dst.world_size)
        for lt in dst.local_tensors(r)
        if all(p.canonical is None for p in lt.pieces)
    ]
    assert padded  # the case this test is about
    for r, st in states.items():
        for name, opt in st.optim.items():
            assert opt["step"].item() == step_value(SALT), (r, name)
    for r, name in padded:
        assert not states[r].params[name].any() and not states[r].optim[name]["exp_avg"].any()
