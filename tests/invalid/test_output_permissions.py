"""A directory a command writes gets the mode ``mkdir`` would give under the umask
(it is written into a temporary directory first, which Python makes owner-only)."""

import os
import stat
from pathlib import Path

import pytest
import torch

from areal_fn.runtime.hf.io import write_hf_checkpoint


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_written_checkpoint_directory_follows_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        out = write_hf_checkpoint(
            tmp_path / "hf", {"w": torch.zeros(2, 2)}, config={"model_type": "x"}
        )
        (tmp_path / "made").mkdir()
    finally:
        os.umask(old)
    mode = stat.S_IMODE(out.stat().st_mode)
    assert mode == 0o777 & ~umask == stat.S_IMODE((tmp_path / "made").stat().st_mode)
