"""Checkpoint checksums against the real libraries: blake3, hashlib, hmac, zipfile, torch DCP.

A save takes every file's BLAKE3 while writing it: each digest in the manifest is
what the ``blake3`` library computes over the file read back, for any cut of the
writes. The tensor archives, written without zip CRC-32s, are read by torch's own
``dcp.load`` and ``torch.load``. A checkpoint whose manifest lists SHA-256 digests, as
saves before BLAKE3 wrote them (``hashlib``'s digests, its keyed digest an
``hmac``-SHA256 over the same canonical JSON), still verifies, loads bitwise, and is
refused when a byte changes.
"""

import hashlib
import hmac
import io
import json
import os
import shutil
import signal
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal_fn.errors import CheckpointError  # noqa: E402
from areal_fn.runtime.checkpoint import hashing  # noqa: E402
from areal_fn.runtime.checkpoint.api import (  # noqa: E402
    inspect_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from areal_fn.runtime.checkpoint.writer import save_tensor  # noqa: E402
from tests.distributed.checkpoint_worker_util import (  # noqa: E402
    blank_state,
    layout,
    model,
    rank_state,
    state_diff,
    truth,
)

SPEC = model()
ALLOC = "fsdp:d2"
LAY = layout(SPEC, ALLOC)
SALT = 3
STEP = f"step-{SALT:08d}"
TRUTH = truth(SPEC, SALT)
KEY = b"team-secret-0123456789abcdef"


def _states() -> dict[int, Any]:
    return {r: rank_state(LAY, r, TRUTH, SALT) for r in range(LAY.world_size)}


def _blank() -> dict[int, Any]:
    return {r: blank_state(LAY, r) for r in range(LAY.world_size)}


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
    return root / STEP


def _canonical(raw: object) -> str:
    return json.dumps(raw, sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_listed_digest_is_the_blake3_of_the_file(tmp_path, threads):
    folder = _save(tmp_path / "root", thread_count=threads)
    raw = json.loads((folder / "manifest.json").read_text())
    on_disk = sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    )
    assert sorted(f["path"] for f in raw["files"]) == on_disk
    assert len([p for p in on_disk if p.endswith(".distcp")]) == threads
    for f in raw["files"]:
        data = (folder / f["path"]).read_bytes()
        assert set(f) == {"path", "size", "blake3"}, f
        assert f["size"] == len(data)
        assert f["blake3"] == blake3.blake3(data).hexdigest(), f["path"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_torch_reads_the_archives_written_without_crc(tmp_path):
    folder = _save(tmp_path / "root")
    want = {t.name: TRUTH["param"][t.name] for t in SPEC.tensors}
    got = {n: torch.empty_like(t) for n, t in want.items()}
    dcp.load(got, storage_reader=FileSystemReader(folder), no_dist=True)  # torch's own reader
    assert all(torch.equal(got[n], want[n]) for n in want)
    raw = json.loads((folder / "manifest.json").read_text())
    entry = next(s for s in raw["storage"] if s["key"] == SPEC.tensors[0].name)
    data = (folder / entry["file"]).read_bytes()[entry["offset"] :][: entry["length"]]
    records = zipfile.ZipFile(io.BytesIO(data)).infolist()
    assert records and all(r.CRC == 0 for r in records)  # the file's BLAKE3 stands for them
    chunk = torch.load(io.BytesIO(data), weights_only=True)
    rows = slice(entry["offsets"][0], entry["offsets"][0] + chunk.shape[0])
    assert torch.equal(chunk, want[entry["key"]][rows])


@given(
    sizes=st.lists(st.integers(0, 300), max_size=12),
    overlap=st.integers(1, 64),
    piece=st.integers(1, 50),
)
def test_the_hash_taken_while_writing_is_the_hash_of_what_was_written(sizes, overlap, piece):
    hashing._OVERLAP, hashing._PIECE = overlap, piece  # small, so that pieces are many
    try:
        data = bytes(i % 251 for i in range(sum(sizes)))
        f = io.BytesIO()
        with hashing.HashingWriter(f) as out:  # type: ignore[arg-type]
            start = 0
            for n in sizes:
                assert out.write(memoryview(data)[start : start + n]) == n
                start += n
                assert out.tell() == start
    finally:
        hashing._OVERLAP, hashing._PIECE = 4 << 20, 8 << 20
    assert f.getvalue() == data
    assert out.hexdigest() == blake3.blake3(data).hexdigest()


def test_save_tensor_writes_what_torch_load_reads():
    t = torch.randn(5, 7).to(torch.bfloat16)
    buf = io.BytesIO()
    save_tensor(t, buf)
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert back.dtype == t.dtype and torch.equal(back.view(torch.int16), t.view(torch.int16))


def _as_sha256(folder: Path, *, key: bytes | None) -> None:
    """The manifest as saves before BLAKE3 wrote it: every file's ``sha256`` (hashlib),
    ``manifest_hmac`` the HMAC-SHA256 of the canonical JSON of the rest, ``manifest_sha256``
    the SHA-256 of the canonical JSON of all that."""
    f = folder / "manifest.json"
    raw = json.loads(f.read_text())
    raw.pop("manifest_sha256")
    raw.pop("manifest_hmac", None)
    raw["files"] = [
        {
            "path": e["path"],
            "size": e["size"],
            "sha256": hashlib.sha256((folder / e["path"]).read_bytes()).hexdigest(),
        }
        for e in raw["files"]
    ]
    if key is not None:
        raw["manifest_hmac"] = hmac.new(key, _canonical(raw).encode(), hashlib.sha256).hexdigest()
    raw["manifest_sha256"] = hashlib.sha256(_canonical(raw).encode()).hexdigest()
    f.write_text(json.dumps(raw))


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "keyed"])
def test_a_checkpoint_with_sha256_digests_verifies_and_loads(tmp_path, key):
    folder = _save(tmp_path / "root", hmac_key=key)
    _as_sha256(folder, key=key)
    manifest = verify_checkpoint(folder, hmac_key=key)
    assert {f.algorithm for f in manifest.files} == {"sha256"}
    states = _blank()
    load_checkpoint(folder, layout=LAY, states=states, optimizer="adam", hmac_key=key)
    want = _states()
    assert all(not state_diff(states[r], want[r]) for r in states)
    assert "every checksum verified: sha256" in inspect_checkpoint(
        folder, verify=True, hmac_key=key
    )
    # the same digests, one file changed
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    data = bytearray((damaged / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError,
        match=r"__0_0\.distcp has sha256 [0-9a-f]{16}\.\.\., the manifest says [0-9a-f]{16}\.\.\.; "
        r"the file is corrupted$",
    ):
        load_checkpoint(damaged, layout=LAY, states=_blank(), optimizer="adam", hmac_key=key)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"path": "x", "size": 1}, r"file 'x' names 0 checksums \(\[\]\)"),
        (
            {"path": "x", "size": 1, "sha256": "0" * 64, "blake3": "0" * 64},
            r"file 'x' names 2 checksums \(\['blake3', 'sha256'\]\)",
        ),
        ({"path": "x", "size": 1, "blake3": "0" * 63}, r"x: blake3 '0{63}' is not 64 lowercase"),
    ],
    ids=["none", "two", "short"],
)
def test_a_file_entry_must_name_one_checksum(tmp_path, entry, message):
    folder = _save(tmp_path / "root")
    f = folder / "manifest.json"
    raw = json.loads(f.read_text())
    raw.pop("manifest_sha256")
    raw["files"].append(entry)
    raw["manifest_sha256"] = hashlib.sha256(_canonical(raw).encode()).hexdigest()
    f.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(folder)


def test_a_process_forked_after_a_verified_load_saves_and_verifies(tmp_path):
    """Hashing uses no thread pool that outlives a call: a child forked after a verified
    load (as a data-loader worker is) saves and verifies instead of hanging."""
    folder = _save(tmp_path / "parent")
    load_checkpoint(folder, layout=LAY, states=_blank(), optimizer="adam")
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if both finish
        code = 1
        try:
            verify_checkpoint(_save(tmp_path / "child"))
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child did not finish its save and verification in 120 s")
