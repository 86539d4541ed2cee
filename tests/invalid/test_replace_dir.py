"""Replacing a finished directory never leaves the destination lost
(:mod:`areal_fn.runtime.replace_dir`), directly and through ``write_hf_checkpoint``: in
one step where the system swaps two names (Linux ``renameat2``), else by two renames."""

import os
from pathlib import Path

import pytest
import torch

from areal_fn.runtime import replace_dir as module
from areal_fn.runtime.hf.io import write_hf_checkpoint
from areal_fn.runtime.replace_dir import replace_dir


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _make(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_an_existing_directory_is_replaced_and_nothing_is_left_beside_it(tmp_path: Path) -> None:
    dest = _make(tmp_path / "out", {"a": b"old", "b": b"old b"})
    new = _make(tmp_path / ".out.tmp", {"a": b"new"})
    replace_dir(new, dest)
    assert _tree(dest) == {"a": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    fresh = _make(tmp_path / ".other.tmp", {"c": b"c"})
    replace_dir(fresh, tmp_path / "other")
    assert _tree(tmp_path / "other") == {"c": b"c"}


def _failing_second_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two-rename path (no swap in one step), its second rename failing."""
    monkeypatch.setattr(module, "_exchange", lambda new, dest: False)
    real = os.replace

    def replace(src: object, dst: object) -> None:
        if Path(str(src)).name.startswith(".") and ".replaced-" not in Path(str(src)).name:
            raise OSError(28, "No space left on device")
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(module.os, "replace", replace)


def test_a_failed_rename_puts_the_old_directory_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = _make(tmp_path / "out", {"a": b"old", "b": b"old b"})
    new = _make(tmp_path / ".out.tmp", {"a": b"new"})
    _failing_second_rename(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        replace_dir(new, dest)
    assert _tree(dest) == {"a": b"old", "b": b"old b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp", "out"]


def test_an_overwriting_hf_write_that_fails_at_the_end_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "hf"
    write_hf_checkpoint(dest, {"w": torch.ones(4)}, config={"model_type": "x"})
    before = _tree(dest)
    _failing_second_rename(monkeypatch)
    with pytest.raises(Exception, match="No space left") as err:
        write_hf_checkpoint(dest, {"w": torch.zeros(4)}, config={"model_type": "x"}, overwrite=True)
    assert f"{dest} holds what it held before" in str(err.value)
    assert _tree(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


SWAPS = module._renameat2() is not None


@pytest.mark.skipif(not SWAPS, reason="no renameat2 here: the two-rename path is tested above")
def test_the_destination_is_swapped_in_one_step_without_a_rename_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = _make(tmp_path / "out", {"a": b"old", "b": b"old b"})
    new = _make(tmp_path / ".out.tmp", {"a": b"new"})

    def no_rename(src: object, dst: object) -> None:
        raise AssertionError(f"renamed {src} -> {dst}: the destination would be missing a while")

    monkeypatch.setattr(module.os, "replace", no_rename)
    replace_dir(new, dest)
    assert _tree(dest) == {"a": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_swap_keeps_the_old_checkpoint_and_leaves_nothing_beside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "hf"
    write_hf_checkpoint(dest, {"w": torch.ones(4)}, config={"model_type": "x"})
    before = _tree(dest)

    def failing(new: Path, old: Path) -> bool:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "_exchange", failing)
    with pytest.raises(Exception, match="No space left") as err:
        write_hf_checkpoint(dest, {"w": torch.zeros(4)}, config={"model_type": "x"}, overwrite=True)
    assert f"{dest} holds what it held before" in str(err.value)
    assert _tree(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
