"""Checkpoints are data, not programs: a crafted checkpoint runs nothing, wherever it is opened.

The attack of the issue, as a new user who receives a checkpoint would meet it: the
``.metadata`` of a saved checkpoint replaced by a pickle that runs a shell command
(``touch <marker>``), then ``manifest.json`` updated as docs/checkpoints.md describes
(the file's size and checksum, ``manifest_sha256`` recomputed). Every way of opening it
(load, reader, HF export, inspect, verify, the CLI, with and without ``trust_pickle``)
refuses it with a ``CheckpointError`` naming the file, the marker never appears, and
the checkpoint is left untouched. The same for payloads in the entries the manifest
locates (an LR-scheduler entry, a tensor chunk), read with ``weights_only=True``.

Foreign pickles need the opt-in: Megatron-Core ``torch_dist`` checkpoints, and our own
saved before the manifest located its entries (``storage``; a checkpoint of the previous
version is this one with that field removed). The keyed digest (``manifest_hmac``) says
whether a job holding the key saved a checkpoint. Every message is pinned.
"""

import hashlib
import json
import os
import pickle
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.errors import CheckpointError  # noqa: E402
from areal_fn.plans.checkpoint.keyed import check_keyed_digest, is_keyed_by  # noqa: E402
from areal_fn.plans.convert import to_megatron  # noqa: E402
from areal_fn.runtime.checkpoint.api import (  # noqa: E402
    CheckpointReader,
    export_hf,
    export_megatron_checkpoint,
    import_megatron_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from areal_fn.runtime.checkpoint.metadata import check_metadata_file, pickle_imports  # noqa: E402
from tests.distributed.checkpoint_worker_util import (  # noqa: E402
    blank_state,
    layout,
    model,
    rank_state,
    state_diff,
    tree_digest,
    truth,
)

SPEC = model()
ALLOC = "fsdp:d2"
LAY = layout(SPEC, ALLOC)
STEP = "step-00000005"
SALT = 5
TRUTH = truth(SPEC, SALT)
KEY = b"team-secret-0123456789abcdef"


def _states() -> dict[int, Any]:
    return {r: rank_state(LAY, r, TRUTH, SALT) for r in range(LAY.world_size)}


def _save(root: Path, **kw: Any) -> Path:
    save_checkpoint(
        root,
        layout=LAY,
        states=_states(),
        model=SPEC,
        allocation=ALLOC,
        step=SALT,
        optimizer="adam",
        lr_scheduler={"last_epoch": 5},
        **kw,
    )
    return root


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("ckpt") / "root")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("keyed") / "root", hmac_key=KEY)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PAYLOAD-RAN"


# -- the attacker's tools ------------------------------------------------------------------


class _Shell:
    """Unpickled, runs ``command`` (``os.system`` pickles as ``posix.system``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def payload(marker: Path, protocol: int = 4) -> bytes:
    return pickle.dumps(_Shell(f"touch {marker}"), protocol=protocol)


def computed_import(marker: Path) -> bytes:
    """posix.system through STACK_GLOBAL whose name is fetched from the memo after a POP:
    unpickled it runs the command, yet its name is no literal just before the import."""
    cmd = f"touch {marker}".encode()
    return (
        b"\x80\x04\x8c\x05posix\x94\x8c\x06system\x94"
        + b"0h\x01\x93"  # POP, BINGET 1, STACK_GLOBAL
        + b"\x8c"
        + bytes([len(cmd)])
        + cmd
        + b"\x85R."  # TUPLE1, REDUCE, STOP
    )


def inst_opcode(marker: Path) -> bytes:
    """Protocol 0's INST: the import and the call in one opcode."""
    return f"(S'touch {marker}'\nios\nsystem\n.".encode()


def resign(folder: Path, edit: Callable[[dict[str, Any]], None] = lambda raw: None) -> None:
    """What anyone can do to a manifest: edit it, put every file's size and checksum (the
    algorithm each entry names, with its own library), and recompute ``manifest_sha256``
    (sha256 of the rest, compact JSON, sorted keys)."""
    f = folder / "manifest.json"
    raw = json.loads(f.read_text())
    raw.pop("manifest_sha256")
    edit(raw)
    for entry in raw["files"]:
        data = (folder / entry["path"]).read_bytes()
        algorithm = "blake3" if "blake3" in entry else "sha256"
        hasher = blake3.blake3 if algorithm == "blake3" else hashlib.sha256
        entry["size"], entry[algorithm] = len(data), hasher(data).hexdigest()
    body = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    raw["manifest_sha256"] = hashlib.sha256(body.encode()).hexdigest()
    f.write_text(json.dumps(raw))


def craft(root: Path, data: bytes) -> Path:
    """The issue's attack: ``.metadata`` replaced by ``data``, the manifest made consistent."""
    folder = root / STEP
    (folder / ".metadata").write_bytes(data)
    resign(folder)
    return folder / ".metadata"


def strip_storage(raw: dict[str, Any]) -> None:
    """The manifest as the previous version wrote it (it did not locate the entries)."""
    raw.pop("storage")


def _copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    return root


def _blank() -> dict[int, Any]:
    return {r: blank_state(LAY, r) for r in range(LAY.world_size)}


def test_each_payload_is_live(tmp_path):
    """Unpickled, each payload of these tests runs its command (so that its refusal counts)."""
    for i, make in enumerate(
        (payload, lambda m: payload(m, 0), lambda m: payload(m, 2), computed_import, inst_opcode)
    ):
        m = tmp_path / f"ran-{i}"
        pickle.loads(make(m))
        assert m.exists(), i


# -- the crafted .metadata, wherever it is opened ------------------------------------------


def _cli(*argv: str) -> Callable[[Path, Path], Any]:
    def call(root: Path, out: Path) -> Any:
        from areal_fn.cli import main

        return main([a.format(root=root, out=out) for a in argv])

    return call


OPENERS: list[tuple[str, Callable[[Path, Path], Any]]] = [
    (
        "load",
        lambda root, out: load_checkpoint(root, layout=LAY, states=_blank(), optimizer="adam"),
    ),
    (
        "load, not verified",
        lambda root, out: load_checkpoint(
            root, layout=LAY, states=_blank(), optimizer="adam", verify=False
        ),
    ),
    (
        "load, trust_pickle",
        lambda root, out: load_checkpoint(
            root, layout=LAY, states=_blank(), optimizer="adam", trust_pickle=True
        ),
    ),
    ("reader", lambda root, out: CheckpointReader(root)),
    ("reader, not verified", lambda root, out: CheckpointReader(root, verify=False)),
    (
        "convert from the checkpoint",
        lambda root, out: to_megatron(CheckpointReader(root, verify=False), LAY, 0),
    ),
    ("export_hf", lambda root, out: export_hf(root, out)),
    ("export_hf, trust_pickle", lambda root, out: export_hf(root, out, trust_pickle=True)),
    (
        "Megatron export from it",
        lambda root, out: export_megatron_checkpoint(CheckpointReader(root), SPEC, out),
    ),
    ("inspect", lambda root, out: inspect_checkpoint(root)),
    ("inspect, verified", lambda root, out: inspect_checkpoint(root, verify=True)),
    ("verify", lambda root, out: verify_checkpoint(root)),
]
CLI_OPENERS = [
    ("areal-fn checkpoint inspect --verify", _cli("checkpoint", "inspect", "{root}", "--verify")),
    ("areal-fn checkpoint inspect", _cli("checkpoint", "inspect", "{root}")),
    ("areal-fn checkpoint export-hf", _cli("checkpoint", "export-hf", "{root}", "{out}")),
    (
        "areal-fn checkpoint export-hf --trust-pickle",
        _cli("checkpoint", "export-hf", "{root}", "{out}", "--trust-pickle"),
    ),
]
REFUSED = (
    r"; a file like this runs code when unpickled \(torch's dcp\.load does\), so the checkpoint "
    r"is refused and nothing of it was unpickled: do not open it with torch either, and get the "
    r"checkpoint again from a source you trust$"
)
PAYLOADS: list[tuple[str, Callable[[Path], bytes], str]] = [
    (
        "protocol 4",
        payload,
        r"is not torch DCP metadata: unpickling it would import posix\.system, which DCP "
        r"metadata never holds" + REFUSED,
    ),
    (
        "protocol 0",
        lambda m: payload(m, 0),
        r"is not torch DCP metadata: unpickling it would import posix\.system",
    ),
    (
        "protocol 2",
        lambda m: payload(m, 2),
        r"is not torch DCP metadata: unpickling it would import posix\.system",
    ),
    (
        "INST",
        inst_opcode,
        r"is not torch DCP metadata: unpickling it would import os\.system, which DCP metadata "
        r"never holds" + REFUSED,
    ),
    (
        "an import by a computed name",
        computed_import,
        r"is not torch DCP metadata: it imports a name it computes while unpickling" + REFUSED,
    ),
    (
        "an extension-registry opcode",
        lambda m: b"\x80\x02\x82\x01.",
        r"is not torch DCP metadata: it uses the pickle opcode EXT1" + REFUSED,
    ),
]


def _assert_refused(call: Callable[[], Any], meta: Path, message: str, *, cli: bool) -> None:
    pattern = re.escape(str(meta)) + " " + message
    if not cli:
        with pytest.raises(CheckpointError, match=pattern):
            call()
        return
    assert call() == 2


@pytest.mark.parametrize(
    ("opener", "call"), OPENERS + CLI_OPENERS, ids=[o[0] for o in OPENERS + CLI_OPENERS]
)
def test_the_crafted_checkpoint_is_refused_and_runs_nothing(
    saved, tmp_path, marker, capsys, opener, call
):
    root = _copy(saved, tmp_path)
    meta = craft(root, payload(marker))
    before = tree_digest(root)
    out = tmp_path / "out"
    message = PAYLOADS[0][2]
    cli = opener.startswith("areal-fn")
    _assert_refused(lambda: call(root, out), meta, message, cli=cli)
    if cli:
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert re.fullmatch("areal-fn: error: " + re.escape(str(meta)) + " " + message, err), err
    assert not marker.exists(), "code from the checkpoint ran"
    assert not out.exists(), "something was written"
    assert tree_digest(root) == before, "the checkpoint was modified"


@pytest.mark.parametrize(("name", "make", "message"), PAYLOADS, ids=[p[0] for p in PAYLOADS])
def test_every_encoding_of_the_payload_is_refused(saved, tmp_path, marker, name, make, message):
    root = _copy(saved, tmp_path)
    meta = craft(root, make(marker))
    for call in (
        lambda: load_checkpoint(root, layout=LAY, states=_blank(), optimizer="adam"),
        lambda: export_hf(root, tmp_path / "hf", trust_pickle=True),
        lambda: inspect_checkpoint(root),
    ):
        with pytest.raises(CheckpointError, match=re.escape(str(meta)) + " " + message):
            call()
    assert not marker.exists()


def test_a_payload_after_the_metadata_is_refused(saved, tmp_path, marker):
    root = _copy(saved, tmp_path)
    good = (root / STEP / ".metadata").read_bytes()
    meta = craft(root, good + payload(marker))
    tail = len(payload(marker))
    with pytest.raises(
        CheckpointError,
        match=re.escape(str(meta))
        + rf" is not torch DCP metadata: it holds {tail} bytes after the end of its pickle"
        + REFUSED,
    ):
        load_checkpoint(root, layout=LAY, states=_blank(), optimizer="adam")
    assert not marker.exists()


def test_the_crafted_checkpoint_in_the_old_form_is_refused_even_when_trusted(
    saved, tmp_path, marker
):
    """Without ``storage`` a load would unpickle ``.metadata`` (with ``trust_pickle``): the
    opcodes are read first, so even then the payload is refused and does not run."""
    root = _copy(saved, tmp_path)
    folder = root / STEP
    (folder / ".metadata").write_bytes(payload(marker))
    resign(folder, strip_storage)
    meta = re.escape(str(folder / ".metadata"))
    for call in (
        lambda: load_checkpoint(
            root, layout=LAY, states=_blank(), optimizer="adam", trust_pickle=True
        ),
        lambda: export_hf(root, tmp_path / "hf", trust_pickle=True),
    ):
        with pytest.raises(CheckpointError, match=meta + " " + PAYLOADS[0][2]):
            call()
    assert not marker.exists()


def test_a_plain_metadata_file_passes_the_check(saved):
    meta = saved / STEP / ".metadata"
    check_metadata_file(meta)
    names = {m for m, _ in pickle_imports(meta.read_bytes())}
    assert names <= {
        "torch",
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.serialization",
        "pathlib",
    }, names


# -- payloads in the entries the manifest locates ----------------------------------------


def _point(root: Path, key: str, offsets: list[int], blob: bytes) -> Path:
    """Append ``blob`` to the data file and make the manifest locate ``key`` there."""
    folder = root / STEP
    data = folder / "__0_0.distcp"
    at = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob)

    def edit(raw: dict[str, Any]) -> None:
        for s in raw["storage"]:
            if s["key"] == key and s["offsets"] == offsets:
                s["offset"], s["length"] = at, len(blob)

    resign(folder, edit)
    return data


def _torch_save(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_payload_as_the_lr_scheduler_entry_is_refused(saved, tmp_path, marker):
    root = _copy(saved, tmp_path)
    _point(root, "train/lr_scheduler", [], _torch_save(_Shell(f"touch {marker}")))
    with pytest.raises(
        CheckpointError,
        match=r"step-00000005: train/lr_scheduler cannot be decoded \(UnpicklingError: Weights "
        r"only load failed.*\); a save writes plain data there \(read with weights_only=True, "
        r"nothing else is run\): the checkpoint is corrupted or was made elsewhere: restore it "
        r"from a copy or use another checkpoint$",
    ):
        load_checkpoint(root, layout=LAY, states=_blank(), optimizer="adam")
    assert not marker.exists()


def test_a_payload_as_a_tensor_chunk_is_refused(saved, tmp_path, marker):
    root = _copy(saved, tmp_path)
    data = _point(root, "model.norm.weight", [0], _torch_save(_Shell(f"touch {marker}")))
    message = (
        re.escape(str(data)) + r" \(model\.norm\.weight\) cannot be read \(UnpicklingError: "
        r"Weights only load failed.*\); the file is corrupted: restore it from a copy or use "
        r"another checkpoint"
    )
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(root, layout=LAY, states=_blank(), optimizer="adam")
    with pytest.raises(CheckpointError, match=message):
        CheckpointReader(root).read("model.norm.weight")
    with pytest.raises(CheckpointError, match=message):
        export_hf(root, tmp_path / "hf")
    assert not marker.exists() and not (tmp_path / "hf").exists()


# -- a checkpoint saved before the manifest located its entries ---------------------------

LEGACY = (
    r"manifest\.json does not say where its entries lie \(no 'storage': saved before areal_fn "
    r"recorded it\), so reading the checkpoint needs its DCP \.metadata, a Python pickle; "
    r"unpickling a file runs any code it holds, so pass trust_pickle=True \(--trust-pickle on "
    r"the command line\) only for a checkpoint you saved yourself or got from a source you "
    r"trust\. Saved again \(load, then save_checkpoint\), it reads without that$"
)
#: The same on the command line, which names its flags (areal_fn.cli.CLI_WORDS).
LEGACY_CLI = LEGACY.replace(
    r"pass trust_pickle=True \(--trust-pickle on the command line\) only",
    "pass --trust-pickle only",
)


@pytest.fixture
def legacy(saved, tmp_path) -> Path:
    root = _copy(saved, tmp_path)
    resign(root / STEP, strip_storage)
    return root


def test_an_older_checkpoint_needs_the_opt_in_then_loads_bitwise(legacy, tmp_path):
    with pytest.raises(CheckpointError, match=LEGACY):
        load_checkpoint(legacy, layout=LAY, states=_blank(), optimizer="adam")
    with pytest.raises(CheckpointError, match=LEGACY):
        CheckpointReader(legacy)
    with pytest.raises(CheckpointError, match=LEGACY):
        export_hf(legacy, tmp_path / "hf")
    states = _blank()
    res = load_checkpoint(legacy, layout=LAY, states=states, optimizer="adam", trust_pickle=True)
    assert res.step == SALT and res.lr_scheduler == {"last_epoch": 5}
    for r in range(LAY.world_size):
        assert state_diff(states[r], rank_state(LAY, r, TRUTH, SALT)) == [], r
    assert "not located by the manifest" in inspect_checkpoint(legacy)
    # saved again, it reads without the opt-in
    again_root = tmp_path / "again"
    save_checkpoint(
        again_root,
        layout=LAY,
        states=states,
        model=SPEC,
        allocation=ALLOC,
        step=6,
        optimizer="adam",
    )
    again = _blank()
    load_checkpoint(again_root, layout=LAY, states=again, optimizer="adam")
    assert all(state_diff(again[r], states[r]) == [] for r in range(LAY.world_size))


def test_an_older_checkpoint_on_the_command_line(legacy, tmp_path, capsys):
    from areal_fn.cli import main

    assert main(["checkpoint", "export-hf", str(legacy), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(LEGACY_CLI, err), err
    assert not (tmp_path / "hf").exists()
    assert (
        main(["checkpoint", "export-hf", str(legacy), str(tmp_path / "hf"), "--trust-pickle"]) == 0
    )
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert main(["checkpoint", "inspect", str(legacy), "--verify"]) == 0
    out = capsys.readouterr().out
    assert (
        "storage: not located by the manifest (saved before it recorded that): reading it "
        "unpickles .metadata, only with trust_pickle=True (--trust-pickle); save it again to "
        "read it without"
    ) in out, out


# -- Megatron-Core checkpoints: pickles only ---------------------------------------------

MEGATRON = (
    r"mcore/\.metadata: a Megatron-Core torch_dist checkpoint says where its tensors lie only "
    r"in this Python pickle; unpickling a file runs any code it holds, so pass "
    r"trust_pickle=True only for a checkpoint you saved yourself or got from a source you "
    r"trust\. Or have its owner export it as HF safetensors, which need no trust$"
)


def test_a_megatron_checkpoint_needs_the_opt_in(saved, tmp_path, marker):
    out = export_megatron_checkpoint(CheckpointReader(saved), SPEC, tmp_path / "mcore")
    with pytest.raises(CheckpointError, match=MEGATRON):
        import_megatron_checkpoint(out, SPEC)
    (out / ".metadata").write_bytes(payload(marker))  # what nobody could tell from outside
    with pytest.raises(CheckpointError, match=MEGATRON):
        import_megatron_checkpoint(out, SPEC)
    assert not marker.exists()


# -- the keyed digest ----------------------------------------------------------------------

NO_DIGEST = (
    r"carries no keyed digest \(manifest_hmac\): it was saved without a key, so nothing shows "
    r"which job wrote it; open it without a key \(hmac_key=None; on the command line, unset "
    r"AREAL_FN_CHECKPOINT_KEY\) only if you trust where it came from$"
)
#: The same on the command line, which names its flags (areal_fn.cli.CLI_WORDS).
NO_DIGEST_CLI = (
    r"carries no keyed digest \(manifest_hmac\): it was saved without a key, so nothing shows "
    r"which job wrote it; open it without a key \(unset AREAL_FN_CHECKPOINT_KEY\) only if you "
    r"trust where it came from$"
)
MISMATCH = (
    r": manifest_hmac does not match the key given: the checkpoint was not saved with this key "
    r"\(it comes from another job, or its manifest was changed after the save\); do not use it, "
    r"or check that the key is the one its job saved with$"
)
SHORT = (
    r"the checkpoint key has 5 bytes; a keyed digest needs at least 16 \(e\.g\. 32 random "
    r"bytes: openssl rand -hex 32\)"
)


def test_a_keyed_checkpoint_loads_with_its_key_only(keyed, saved, tmp_path):
    manifest = read_manifest(keyed)
    assert manifest.keyed_digest is not None and is_keyed_by(manifest, KEY)
    assert not is_keyed_by(manifest, b"another-key-0123456789")
    load_checkpoint(keyed, layout=LAY, states=_blank(), optimizer="adam", hmac_key=KEY)
    load_checkpoint(keyed, layout=LAY, states=_blank(), optimizer="adam")  # no key: not checked
    with pytest.raises(CheckpointError, match=MISMATCH):
        load_checkpoint(
            keyed, layout=LAY, states=_blank(), optimizer="adam", hmac_key=b"another-key-0123456"
        )
    with pytest.raises(CheckpointError, match=NO_DIGEST):
        load_checkpoint(saved, layout=LAY, states=_blank(), optimizer="adam", hmac_key=KEY)
    with pytest.raises(CheckpointError, match=NO_DIGEST):
        CheckpointReader(saved, verify=False, hmac_key=KEY)
    with pytest.raises(CheckpointError, match=SHORT):
        check_keyed_digest(manifest, b"short")
    with pytest.raises(CheckpointError, match=r"cannot save checkpoint .*: " + SHORT):
        _save(tmp_path / "short", hmac_key=b"short")
    assert not (tmp_path / "short" / "step-00000005").exists()


def test_a_keyed_digest_catches_what_a_checksum_cannot(keyed, tmp_path, marker):
    """The attack on a keyed checkpoint: checksums and manifest_sha256 recomputed, the keyed
    digest left (nobody without the key can remake it): refused by the key."""
    root = _copy(keyed, tmp_path)
    craft(root, payload(marker))
    with pytest.raises(CheckpointError, match=MISMATCH):
        load_checkpoint(root, layout=LAY, states=_blank(), optimizer="adam", hmac_key=KEY)
    with pytest.raises(CheckpointError, match=MISMATCH):
        inspect_checkpoint(root, verify=True, hmac_key=KEY)
    assert not marker.exists()


def test_the_keyed_digest_on_the_command_line(keyed, saved, tmp_path, capsys, monkeypatch):
    from areal_fn.cli import main

    monkeypatch.setenv("AREAL_FN_CHECKPOINT_KEY", KEY.decode())
    assert main(["checkpoint", "inspect", str(keyed), "--verify"]) == 0
    out = capsys.readouterr().out
    assert (
        "keyed digest: matches the key given (every file's checksum verified: it vouches for the "
        "files too)"
    ) in out, out
    assert main(["checkpoint", "inspect", str(keyed)]) == 0
    assert "it vouches for the manifest; pass verify to check the files" in capsys.readouterr().out
    assert main(["checkpoint", "export-hf", str(saved), str(tmp_path / "hf")]) == 2
    assert re.search(NO_DIGEST_CLI, capsys.readouterr().err.strip())
    monkeypatch.setenv("AREAL_FN_CHECKPOINT_KEY", "another-key-0123456789")
    assert main(["checkpoint", "inspect", str(keyed), "--verify"]) == 2
    assert re.search(MISMATCH, capsys.readouterr().err.strip())
    monkeypatch.setenv("AREAL_FN_CHECKPOINT_KEY", "short")
    assert main(["checkpoint", "inspect", str(keyed)]) == 2
    assert capsys.readouterr().err.strip() == (
        "areal-fn: error: AREAL_FN_CHECKPOINT_KEY holds 5 bytes; a checkpoint key needs at "
        "least 16 (e.g. export AREAL_FN_CHECKPOINT_KEY=$(openssl rand -hex 32)), or unset it "
        "to open checkpoints without checking who saved them"
    )
    monkeypatch.delenv("AREAL_FN_CHECKPOINT_KEY")
    assert main(["checkpoint", "inspect", str(keyed)]) == 0
    assert (
        "keyed digest: present, not checked (no key given: hmac_key=, or AREAL_FN_CHECKPOINT_KEY)"
        in capsys.readouterr().out
    )
    assert main(["checkpoint", "inspect", str(saved)]) == 0
    assert "keyed digest: none (saved without a key)" in capsys.readouterr().out


def test_manifests_with_and_without_the_new_fields_round_trip(keyed, legacy):
    """Reading a manifest and writing it back gives its very text: the keyed and located one
    of this version, and the previous version's (no ``storage``, no ``manifest_hmac``)."""
    from areal_fn.plans.checkpoint.manifest import CheckpointManifest

    text = (keyed / STEP / "manifest.json").read_text()
    m = CheckpointManifest.from_json(text)
    assert m.storage and m.keyed_digest and m.to_json() == text
    old = CheckpointManifest.from_json((legacy / STEP / "manifest.json").read_text())
    assert not old.storage and old.keyed_digest is None
    assert CheckpointManifest.from_json(old.to_json()) == old
    raw_old = json.loads(old.to_json())
    assert "storage" not in raw_old and "manifest_hmac" not in raw_old


# -- manifests that point elsewhere --------------------------------------------------------


def _edit_storage(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        change(raw["storage"][1])

    return edit


BAD_MANIFESTS = [
    (
        "an entry in another file",
        _edit_storage(lambda s: s.update(file="manifest.json")),
        r"manifest\.json: storage entry '.+' at \(.*\) lies in 'manifest\.json', not a DCP data "
        r"file \(__<n>_<m>\.distcp\); the manifest is inconsistent$",
    ),
    (
        "an entry beyond the end of its file",
        _edit_storage(lambda s: s.update(offset=10**9)),
        r"manifest\.json: storage entry '.+' at \(.*\) takes bytes 1000000000\.\.\d+ of "
        r"__0_0\.distcp, which the manifest lists with \d+ bytes; the manifest is inconsistent$",
    ),
    (
        "an entry listed twice",
        lambda raw: raw["storage"].append(raw["storage"][0]),
        r"manifest\.json: storage entry 'train/lr_scheduler' at \(\) is listed twice; the "
        r"manifest is inconsistent$",
    ),
    (
        "an entry missing",
        lambda raw: raw["storage"].pop(1),
        r"manifest\.json: storage misses 1 entries the tensors imply \(.+ at \(.*\)\); the "
        r"manifest is inconsistent$",
    ),
    (
        "a file outside the directory",
        lambda raw: raw["files"].append({"path": "../x", "size": 0, "blake3": "0" * 64}),
        r"manifest\.json: file '\.\./x' is not a path inside the checkpoint directory \(no "
        r"'\.\.', not absolute\)$",
    ),
    (
        "a keyed digest that is not one",
        lambda raw: raw.update(manifest_hmac="zz"),
        r"manifest\.json: manifest_hmac 'zz' is not 64 lowercase hex digits$",
    ),
]


@pytest.mark.parametrize(
    ("name", "edit", "message"), BAD_MANIFESTS, ids=[b[0] for b in BAD_MANIFESTS]
)
def test_a_manifest_that_points_elsewhere_is_refused(saved, tmp_path, name, edit, message):
    root = _copy(saved, tmp_path)
    folder = root / STEP
    f = folder / "manifest.json"
    raw = json.loads(f.read_text())
    raw.pop("manifest_sha256")
    edit(raw)  # no file recomputed: the edit itself is refused
    body = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    raw["manifest_sha256"] = hashlib.sha256(body.encode()).hexdigest()
    f.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(root, layout=LAY, states=_blank(), optimizer="adam")


# -- the remaining refusals of metadata.py -------------------------------------------------


def test_a_missing_metadata_file_is_refused(saved, tmp_path):
    root = _copy(saved, tmp_path)
    folder = root / STEP
    (folder / ".metadata").unlink()
    resign(
        folder, lambda raw: raw.update(files=[f for f in raw["files"] if f["path"] != ".metadata"])
    )
    with pytest.raises(
        CheckpointError,
        match=re.escape(str(folder / ".metadata")) + r" is missing; the checkpoint is incomplete: "
        r"restore it from a copy or use another checkpoint$",
    ):
        load_checkpoint(root, layout=LAY, states=_blank(), optimizer="adam")


def test_trusted_metadata_that_is_no_metadata_is_refused(legacy, tmp_path):
    folder = legacy / STEP
    from torch.distributed.checkpoint.metadata import StorageMeta

    # only DCP's classes: passes the opcode check, unpickles, but is not the metadata
    (folder / ".metadata").write_bytes(pickle.dumps(StorageMeta()))
    resign(folder)
    with pytest.raises(
        CheckpointError,
        match=re.escape(str(folder / ".metadata")) + r" holds a StorageMeta, not torch DCP "
        r"metadata; the file is corrupted: restore it from a copy or use another checkpoint$",
    ):
        load_checkpoint(legacy, layout=LAY, states=_blank(), optimizer="adam", trust_pickle=True)


def test_a_damaged_megatron_metadata_is_refused_when_trusted(saved, tmp_path):
    out = export_megatron_checkpoint(CheckpointReader(saved), SPEC, tmp_path / "mcore")
    (out / ".metadata").write_bytes(bytes(100))
    with pytest.raises(
        CheckpointError,
        match=r"mcore/\.metadata cannot be read as torch DCP metadata \(UnpicklingError: invalid "
        r"load key, '\\x00'\.\); the file is corrupted: restore it from a copy or use another "
        r"checkpoint$",
    ):
        import_megatron_checkpoint(out, SPEC, trust_pickle=True)


def test_what_a_save_cannot_record_is_refused():
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from areal_fn.runtime.checkpoint.metadata import stored_items

    with pytest.raises(
        CheckpointError,
        match=r"torch DCP did not report where it wrote the entries \(Metadata\.storage_data\); "
        r"this torch version \(.+\) is not supported$",
    ):
        stored_items(None)
    info = _StorageInfo("__0_0.distcp", 0, 10, transform_descriptors=["zstd"])
    md = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w", (0,)): info})
    with pytest.raises(
        CheckpointError,
        match=r"torch DCP wrote w through transforms \['zstd'\]; only plain torch\.save entries "
        r"are supported$",
    ):
        stored_items(md)
