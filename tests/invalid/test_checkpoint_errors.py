"""One table of bad checkpoints and bad calls, with the messages they must raise.

Each case gets its own copy of one small checkpoint (saved offline: both ranks of
``fsdp:d2`` in this process), damages it, and calls the function. Every error is a
``CheckpointError`` naming the file or tensor and what was expected; a load never
modifies the checkpoint (every file's bytes and mtime are compared before and after).
"""

import contextlib
import errno
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors import SafetensorError

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.errors import CheckpointError  # noqa: E402
from areal_fn.layouts.layout import FusionPiece, Layout, LogicalTensor  # noqa: E402
from areal_fn.model.tensor_spec import TensorSpec  # noqa: E402
from areal_fn.plans.checkpoint import (  # noqa: E402
    CheckpointManifest,
    Chunk,
    SavedTensor,
    optimizer_spec,
    plan_save,
)
from areal_fn.runtime.checkpoint.api import (  # noqa: E402
    CheckpointReader,
    RankState,
    export_megatron_checkpoint,
    import_megatron_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from areal_fn.sharding.box import Box  # noqa: E402
from areal_fn.sharding.mesh import Mesh  # noqa: E402
from areal_fn.sharding.placement import Replicate  # noqa: E402
from areal_fn.sharding.sharding import Sharding  # noqa: E402
from tests.distributed.checkpoint_worker_util import (  # noqa: E402
    blank_state,
    layout,
    model,
    rank_state,
    tree_digest,
    truth,
)

SPEC = model()
ALLOC = "fsdp:d2"
LAY = layout(SPEC, ALLOC)
STEP = "step-00000005"


def _states(salt: int = 5) -> dict[int, RankState]:
    t = truth(SPEC, salt)
    return {r: rank_state(LAY, r, t, salt) for r in range(LAY.world_size)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt") / "root"
    save_checkpoint(
        root,
        layout=LAY,
        states=_states(),
        model=SPEC,
        allocation=ALLOC,
        step=5,
        optimizer="adam",
        data_position={"sample": 5},
    )
    return root


# -- damage ---------------------------------------------------------------------------


def flip_byte(name: str) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        f = root / STEP / name
        data = bytearray(f.read_bytes())
        data[len(data) // 3] ^= 0x40
        f.write_bytes(bytes(data))

    return damage


def truncate(name: str) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        f = root / STEP / name
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    return damage


def zero(name: str) -> Callable[[Path], None]:
    """Overwrite a file with zeros, keeping its size (only its checksum tells)."""

    def damage(root: Path) -> None:
        f = root / STEP / name
        f.write_bytes(bytes(f.stat().st_size))

    return damage


def zero_tail(name: str) -> Callable[[Path], None]:
    """Overwrite the second half of a file with zeros, keeping its size."""

    def damage(root: Path) -> None:
        f = root / STEP / name
        data = f.read_bytes()
        half = len(data) // 2
        f.write_bytes(data[:half] + bytes(len(data) - half))

    return damage


def delete(name: str) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        (root / STEP / name).unlink()

    return damage


def add_file(root: Path) -> None:
    (root / STEP / "__7_0.distcp").write_bytes(b"stray")


def edit_manifest(
    edit: Callable[[dict[str, Any]], None], *, resign: bool
) -> Callable[[Path], None]:
    """Change the manifest JSON; with ``resign`` recompute its digest (a consistent lie)."""

    def damage(root: Path) -> None:
        f = root / STEP / "manifest.json"
        raw = json.loads(f.read_text())
        raw.pop("manifest_sha256")
        edit(raw)
        if resign:
            import hashlib

            body = json.dumps(raw, sort_keys=True, separators=(",", ":"))
            raw["manifest_sha256"] = hashlib.sha256(body.encode()).hexdigest()
        f.write_text(json.dumps(raw))

    return damage


def drop_tensor(raw: dict[str, Any]) -> None:
    """Drop a tensor and where its entries lie (a consistent lie)."""
    drop_tensor_only(raw)
    keys = {
        "model.norm.weight",
        *(f"optim/model.norm.weight/{s}" for s, _ in raw["optimizer"]["states"]),
    }
    raw["storage"] = [s for s in raw["storage"] if s["key"] not in keys]


def drop_tensor_only(raw: dict[str, Any]) -> None:
    raw["tensors"] = [t for t in raw["tensors"] if t["name"] != "model.norm.weight"]


def set_step(raw: dict[str, Any]) -> None:
    raw["step"] = 6


def latest_to(name: str) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        (root / "latest").write_text(name)

    return damage


def nothing(root: Path) -> None:
    pass


# -- calls ----------------------------------------------------------------------------


def load(
    optimizer: str = "adam", spec: Any = SPEC, alloc: str = ALLOC, **kw: Any
) -> Callable[[Path], Any]:
    def call(root: Path) -> Any:
        lay = layout(spec, alloc)
        states = {r: blank_state(lay, r) for r in range(lay.world_size)}
        if optimizer == "none":
            states = {r: RankState(params=s.params) for r, s in states.items()}
        if optimizer == "sgd":
            states = {
                r: RankState(
                    params=s.params,
                    optim={
                        n: {"momentum_buffer": torch.zeros_like(v, dtype=torch.float32)}
                        for n, v in s.params.items()
                    },
                )
                for r, s in states.items()
            }
        return load_checkpoint(root, layout=lay, states=states, optimizer=optimizer, **kw)

    return call


def load_fp32(root: Path) -> Any:
    states = {r: blank_state(LAY, r) for r in range(LAY.world_size)}
    for s in states.values():
        s.params = {n: v.float() for n, v in s.params.items()}
    return load_checkpoint(root, layout=LAY, states=states, optimizer="adam")


def load_misshaped(root: Path) -> Any:
    states = {r: blank_state(LAY, r) for r in range(LAY.world_size)}
    states[1].params["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    return load_checkpoint(root, layout=LAY, states=states, optimizer="adam")


def save(step: int = 6, **kw: Any) -> Callable[[Path], Any]:
    def call(root: Path) -> Any:
        args: dict[str, Any] = dict(
            layout=LAY, states=_states(), model=SPEC, allocation=ALLOC, step=step, optimizer="adam"
        )
        args.update(kw)
        return save_checkpoint(root, **args)

    return call


class _FullDisk:
    """A file that takes ``room`` bytes, then raises ENOSPC (as a full disk does)."""

    def __init__(self, stream: Any, room: int) -> None:
        self._stream, self._room = stream, room

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self._room:
            self._stream.write(memoryview(data).cast("B")[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= n
        return int(self._stream.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def save_onto_full_disk(root: Path) -> Any:
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Any:
        with real(self, path, mode) as stream:
            yield _FullDisk(stream, 4096) if "w" in mode else stream

    with mock.patch.object(filesystem.FileSystem, "create_stream", create_stream):
        return save()(root)


def read_unverified(root: Path) -> Any:
    return CheckpointReader(root, verify=False).read("model.norm.weight")


def read_missing(root: Path) -> Any:
    return CheckpointReader(root).read("lm_head.weight")


def plan_partial(root: Path) -> Any:
    mesh = Mesh.of(dp=2)
    spec = TensorSpec(name="w", shape=(4,), dtype="float32")
    t = LogicalTensor(
        name="w_local",
        shape=(2,),
        dtype="float32",
        fusion=(
            FusionPiece(
                canonical="w",
                canonical_box=Box(ranges=((0, 2),)),
                logical_box=Box(ranges=((0, 2),)),
            ),
        ),
        sharding=Sharding(mesh=mesh, placements=(Replicate(),)),
    )
    return plan_save(Layout(kind="synthetic", world_size=2, canonical=(spec,), tensors=(t,)))


def overlapping_chunks(root: Path) -> Any:
    box = Box(ranges=((0, 3),))
    return SavedTensor(
        name="w",
        shape=(4,),
        dtype="float32",
        chunks=(Chunk(box=box, rank=0), Chunk(box=Box(ranges=((2, 4),)), rank=1)),
    )


def gapped_chunks(root: Path) -> Any:
    return SavedTensor(
        name="w", shape=(4,), dtype="float32", chunks=(Chunk(box=Box(ranges=((0, 3),)), rank=0),)
    )


def mcore_export(spec: Any = SPEC, **kw: Any) -> Callable[[Path], Any]:
    def call(root: Path) -> Any:
        return export_megatron_checkpoint(CheckpointReader(root), spec, root.parent / "mcore", **kw)

    return call


def mcore_import_other_model(root: Path) -> Any:
    out = export_megatron_checkpoint(CheckpointReader(root), SPEC, root.parent / "mcore")
    return import_megatron_checkpoint(out, model(intermediate_size=96), trust_pickle=True)


def mcore_import_not_megatron(root: Path) -> Any:
    return import_megatron_checkpoint(root / STEP, SPEC, trust_pickle=True)


def not_a_manifest(root: Path) -> Any:
    return CheckpointManifest.from_json('{"format": "something else"}', source="x.json")


CASES = [
    # name, damage, call, message
    (
        "flipped byte in a data file",
        flip_byte("__0_0.distcp"),
        load(),
        r"__0_0\.distcp has blake3 [0-9a-f]{16}\.\.\., the manifest says [0-9a-f]{16}\.\.\.; the file is corrupted",
    ),
    (
        "flipped byte in DCP metadata",
        flip_byte(".metadata"),
        load(),
        r"\.metadata has blake3 .* the file is corrupted",
    ),
    (
        "truncated data file",
        truncate("__0_0.distcp"),
        load(),
        r"__0_0\.distcp has \d+ bytes, the manifest says \d+; the file is truncated or corrupted",
    ),
    (
        "truncated data file, not verified",
        truncate("__0_0.distcp"),
        load(verify=False),
        r"__0_0\.distcp has \d+ bytes, the manifest says \d+; the file is truncated or corrupted: "
        r"restore it from a copy or load another step",
    ),
    (
        "truncated DCP metadata, not verified",
        truncate(".metadata"),
        load(verify=False),
        r"\.metadata has \d+ bytes, the manifest says \d+; the file is truncated or corrupted",
    ),
    (
        "zeroed data file, not verified",
        zero("__0_0.distcp"),
        load(verify=False),
        r"__0_0\.distcp \((optim/)?model\.[a-z_.0-9/]+\): the \d+ bytes at offset 0 are not a torch\.save "
        r"archive; the file is corrupted: restore it from a copy or use another checkpoint$",
    ),
    (
        "data file zeroed from its middle, not verified",
        zero_tail("__0_0.distcp"),
        load(verify=False),
        r"__0_0\.distcp \(.+\): the \d+ bytes at offset \d+ are not a torch\.save archive; the file "
        r"is corrupted: restore it from a copy or use another checkpoint; the local tensors may be "
        r"partly overwritten: load them again before using them \(verify=True checks every file's "
        r"checksum before any tensor is touched\)",
    ),
    (
        "zeroed DCP metadata, not verified",
        zero(".metadata"),
        load(verify=False),
        r"\.metadata cannot be read as torch DCP metadata \(not a pickle: ValueError: at position 0, "
        r"opcode b'\\x00' unknown\); the file is corrupted: restore it from a copy or use another "
        r"checkpoint$",
    ),
    (
        "reading a truncated file, not verified",
        truncate("__0_0.distcp"),
        read_unverified,
        r"__0_0\.distcp has \d+ bytes, the manifest says \d+; the file is truncated or corrupted",
    ),
    (
        "truncated manifest",
        truncate("manifest.json"),
        load(),
        r"manifest\.json is not valid JSON .*; the file is corrupted or truncated",
    ),
    (
        "edited manifest",
        edit_manifest(set_step, resign=False),
        load(),
        r"manifest\.json: manifest_sha256 does not match its content; the manifest was modified or corrupted",
    ),
    (
        "deleted data file",
        delete("__0_0.distcp"),
        load(),
        r"__0_0\.distcp is listed in the manifest but missing; the checkpoint is incomplete",
    ),
    (
        "deleted manifest",
        delete("manifest.json"),
        load(),
        r"latest names step-00000005, but .*step-00000005/manifest\.json does not exist",
    ),
    (
        "stray file",
        add_file,
        load(),
        r"holds files the manifest does not list: \['__7_0\.distcp'\]; the checkpoint was modified",
    ),
    (
        "manifest of another model",
        nothing,
        load(spec=model(hidden_size=128)),
        r"was saved for another model \(qwen2, hidden_size=64, num_hidden_layers=4, vocab_size=250\): \d+ tensors differ in shape \(model\.embed_tokens\.weight: saved \(250, 64\), expected \(250, 128\)",
    ),
    (
        "model with a tensor the checkpoint lacks",
        nothing,
        load(spec=model(tie_word_embeddings=False)),
        r"1 tensors are missing \(lm_head\.weight\)",
    ),
    (
        "model without a tensor the checkpoint has",
        nothing,
        load(spec=model(num_hidden_layers=3)),
        r"tensors are not in the model \(model\.layers\.3\.",
    ),
    (
        "manifest (re-signed) missing a tensor",
        edit_manifest(drop_tensor, resign=True),
        load(),
        r"1 tensors are missing \(model\.norm\.weight\)",
    ),
    (
        "manifest (re-signed) missing a tensor, not where its entries lie",
        edit_manifest(drop_tensor_only, resign=True),
        load(),
        r"manifest\.json: storage locates 7 entries no tensor implies \(model\.norm\.weight at "
        r"\(0,\), model\.norm\.weight at \(32,\), optim/model\.norm\.weight/exp_avg at \(0,\), "
        r"\.\.\.\); the manifest is inconsistent$",
    ),
    (
        "incompatible optimizer",
        nothing,
        load(optimizer="sgd"),
        r"holds optimizer state of adam\(exp_avg, exp_avg_sq, step\), the target optimizer is sgd\(momentum_buffer\); load with the same optimizer, or with optimizer 'none'",
    ),
    (
        "dtype differs from the stored one",
        nothing,
        load_fp32,
        r"model\.embed_tokens\.weight parameter is stored as bfloat16, rank 0's model\.embed_tokens\.weight is float32; pass allow_cast=True",
    ),
    (
        "local state of the wrong shape",
        nothing,
        load_misshaped,
        r"local states do not match the fsdp2 layout: rank 1 mis-shaped \['model\.norm\.weight \(3,\) != \(32,\)'\]",
    ),
    (
        "latest names a missing directory",
        latest_to("step-00000009"),
        load(),
        r"latest names step-00000009, but .*step-00000009/manifest\.json does not exist",
    ),
    (
        "not a checkpoint at all",
        delete("../latest"),
        load(),
        r"is not a checkpoint: it holds neither manifest\.json nor a 'latest' pointer",
    ),
    (
        "latest is garbage",
        latest_to("../../etc"),
        load(),
        r"latest holds '\.\./\.\./etc', not a checkpoint directory name like 'step-00000012'",
    ),
    (
        "reading a tensor the checkpoint lacks",
        nothing,
        read_missing,
        r"holds no tensor 'lm_head\.weight'",
    ),
    (
        "saving over the latest step",
        nothing,
        save(step=5),
        r"step-00000005 is the latest checkpoint already; save under a new step",
    ),
    (
        "saving onto a full disk",
        nothing,
        save_onto_full_disk,
        r"cannot save checkpoint .*step-00000006: writing its files failed \(OSError: \[Errno 28\] No "
        r"space left on device\); .*\.tmp-step-00000006 was removed and the checkpoints saved before "
        r"are untouched; fix that \(e\.g\. free disk space\) and save again",
    ),
    ("keep < 1", nothing, save(keep=0), r"keep=0 must be >= 1"),
    ("negative step", nothing, save(step=-1), r"step=-1 must be >= 0"),
    (
        "no writer thread",
        nothing,
        save(thread_count=0),
        r"thread_count=0 must be >= 1 \(the data files each process writes at once\)$",
    ),
    (
        "a rank missing from an offline save",
        nothing,
        save(states={0: _states()[0]}),
        r"every rank of the fsdp2 layout must be passed by exactly one process; missing \[1\], passed twice \[\]",
    ),
    (
        "optimizer state without naming the optimizer",
        nothing,
        save(optimizer="none"),
        r"rank 0 passes optimizer state but optimizer='none'; name the optimizer",
    ),
    (
        "data position that is not JSON",
        nothing,
        save(data_position={"x": object()}),
        r"TypeError: Object of type object is not JSON serializable",
    ),
    (
        "unknown optimizer",
        nothing,
        lambda root: optimizer_spec("adafactor"),
        r"optimizer='adafactor' is not known; use one of \['adam', 'adamw', 'none', 'sgd'\]",
    ),
    (
        "layout that holds part of a tensor",
        nothing,
        plan_partial,
        r"w\[2:4\] is held by no rank of the synthetic layout \(2 ranks\); a checkpoint stores whole canonical tensors",
    ),
    (
        "chunks holding too much",
        nothing,
        overlapping_chunks,
        r"tensor 'w': its chunks hold 5 elements, its shape \(4,\) has 4",
    ),
    (
        "chunks leaving a gap",
        nothing,
        gapped_chunks,
        r"tensor 'w': its chunks hold 3 elements, its shape \(4,\) has 4; the chunks must tile",
    ),
    (
        "Megatron import of a directory that is not a Megatron checkpoint",
        nothing,
        mcore_import_not_megatron,
        r"is not a Megatron-Core dist checkpoint: metadata\.json cannot be read",
    ),
    (
        "Megatron import with another model",
        nothing,
        mcore_import_other_model,
        r"decoder\.layers\.mlp\.linear_fc1\.weight has shape \(4, 256, 64\), qwen2 with hidden_size=64, 4 layers needs \(4, 192, 64\)",
    ),
    (
        "Megatron export with too few vocabulary rows",
        nothing,
        mcore_export(vocab_size_padded=100),
        r"vocab_size_padded=100 is smaller than vocab_size=250",
    ),
    ("not a manifest", nothing, not_a_manifest, r"x\.json is not an areal_fn checkpoint manifest"),
]


@pytest.mark.parametrize(("name", "damage", "call", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_checkpoint_raises_and_is_left_untouched(saved, tmp_path, name, damage, call, message):
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    damage(root)
    before = tree_digest(root)
    with pytest.raises(CheckpointError, match=message):
        call(root)
    if name.startswith(
        ("saving", "keep", "negative", "a rank", "optimizer state", "data position")
    ):
        assert sorted(p.name for p in root.iterdir()) == ["latest", STEP], (
            "a refused save left files"
        )
    assert tree_digest(root) == before, "the checkpoint was modified"


def test_unverified_load_of_a_truncated_file_touches_no_tensor(saved, tmp_path):
    """The sizes are checked before reading even with ``verify=False``: nothing is written."""
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    truncate("__0_0.distcp")(root)
    states = {r: blank_state(LAY, r) for r in range(LAY.world_size)}
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp has \d+ bytes"):
        load_checkpoint(root, layout=LAY, states=states, optimizer="adam", verify=False)
    for st in states.values():
        assert all(torch.isnan(t.float()).all() for t in st.params.values())
        assert all(torch.isnan(s["exp_avg"]).all() for s in st.optim.values())
        assert all(s["step"].item() == -1.0 for s in st.optim.values())


def test_overlap_is_named_when_volumes_agree():
    with pytest.raises(
        CheckpointError, match=r"tensor 'w': chunks \[0:2, 0:2\] and \[1:2, 0:2\] overlap"
    ):
        SavedTensor(
            name="w",
            shape=(3, 2),
            dtype="float32",
            chunks=(
                Chunk(box=Box(ranges=((0, 2), (0, 2))), rank=0),
                Chunk(box=Box(ranges=((1, 2), (0, 2))), rank=1),
            ),
        )


def test_the_undamaged_checkpoint_loads(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    res = load()(root)
    assert res.step == 5 and res.data_position == {"sample": 5}


def test_export_hf_onto_a_full_disk_is_one_line_and_leaves_nothing(
    saved, tmp_path, capsys, monkeypatch
):
    """``areal-fn checkpoint export-hf`` when the disk fills: exit 2, one line, no output."""
    import areal_fn.runtime.hf.io as hf_io
    from areal_fn.cli import main

    real = hf_io.save_file

    def save_file(tensors: Any, filename: str, metadata: Any = None) -> None:
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(1000)
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(hf_io, "save_file", save_file)
    out = tmp_path / "exports" / "hf"
    before = tree_digest(saved)
    assert main(["checkpoint", "export-hf", str(saved), str(out)]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1, line
    assert re.fullmatch(
        rf"areal-fn: error: cannot write {re.escape(str(out))} \(its shard 1\): No space left on "
        r"device \(ENOSPC\); free space on the disk of \S+ or write elsewhere; nothing was written "
        rf"to {re.escape(str(out))}",
        line,
    ), line
    assert list((tmp_path / "exports").iterdir()) == []
    assert tree_digest(saved) == before
