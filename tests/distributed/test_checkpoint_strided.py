"""Checkpoints of gpt-oss under Megatron-Core, whose experts are strided pieces.

``linear_fc1`` of an expert is ``gate_up_proj[e]`` de-interleaved and transposed; the
save and load plans place it in the lifted basis and read or write views of the
parameters and their Adam moments (:mod:`areal_fn.layouts.lift`), while the stored
chunks stay plain boxes of the canonical tensors. In one process, every rank of each
layout: saved from Megatron and from FSDP2, loaded into Megatron under other
strategies and into FSDP2, both ways of reading a chunk, the non-blocking (copying)
save, and the HF export. The oracle is the conversion (``to_megatron`` of the canonical
truth for each rank), not the plans.
"""

from pathlib import Path

import pytest
import torch

import areal_fn.runtime.checkpoint.dcp as ckpt_dcp
from areal_fn.model.spec import model_from_hf_config
from areal_fn.runtime.checkpoint.api import export_hf, load_checkpoint, save_checkpoint
from areal_fn.runtime.hf.io import HfCheckpoint
from tests.distributed.checkpoint_worker_util import (
    bits,
    blank_state,
    layout,
    rank_state,
    state_diff,
    truth,
)
from tests.distributed.test_weight_sync_strided import CONFIG

#: the sync tests' tiny gpt-oss, in bf16, with a vocabulary Megatron pads (200 -> 256):
#: padding rows on the last TP rank
SPEC = model_from_hf_config({**CONFIG, "vocab_size": 200, "torch_dtype": "bfloat16"})
SALT = 5
TRUTH = truth(SPEC, SALT)


def save(root: Path, allocation: str, *, blocking: bool = True) -> Path:
    lay = layout(SPEC, allocation)
    assert lay.is_strided == allocation.startswith("megatron")
    out = save_checkpoint(
        root,
        layout=lay,
        states={r: rank_state(lay, r, TRUTH, SALT) for r in range(lay.world_size)},
        model=SPEC,
        allocation=allocation,
        step=SALT,
        optimizer="adam",
        blocking=blocking,
    )
    if not blocking:
        out.wait()  # type: ignore[union-attr]
    return root


@pytest.fixture(scope="module")
def from_megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("strided") / "megatron", "megatron:d2e2p2")


@pytest.fixture(scope="module")
def from_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("strided") / "fsdp2", "fsdp:d2")


def load_and_compare(root: Path, allocation: str) -> None:
    lay = layout(SPEC, allocation)
    states = {r: blank_state(lay, r) for r in range(lay.world_size)}
    storage = {r: {n: t.data_ptr() for n, t in s.params.items()} for r, s in states.items()}
    load_checkpoint(root, layout=lay, states=states, optimizer="adam")
    for r in range(lay.world_size):
        assert state_diff(states[r], rank_state(lay, r, TRUTH, SALT)) == [], (allocation, r)
        assert {n: t.data_ptr() for n, t in states[r].params.items()} == storage[r]


@pytest.mark.parametrize("raw", [True, False], ids=["raw bytes", "torch.load fallback"])
@pytest.mark.parametrize("dst", ["megatron:d2e2p2", "megatron:t2e2", "megatron:p2", "fsdp:d4"])
def test_a_megatron_checkpoint_loads_bitwise(from_megatron, monkeypatch, dst, raw) -> None:  # type: ignore[no-untyped-def]
    if not raw:
        monkeypatch.setattr(ckpt_dcp, "_raw_offset", lambda *a: None)
    buffered: list[tuple[int, ...]] = []

    class Counted(ckpt_dcp._Reshaped):
        def __init__(self, region: torch.Tensor, shape: tuple[int, ...]) -> None:
            super().__init__(region, shape)
            buffered.append(shape)

    monkeypatch.setattr(ckpt_dcp, "_Reshaped", Counted)
    load_and_compare(from_megatron, dst)
    # a Megatron destination reads its experts' fc1 through buffers (permuted views)
    assert bool(buffered) == dst.startswith("megatron")


@pytest.mark.parametrize("dst", ["megatron:d2e2p2", "megatron:d2e2"])
def test_an_fsdp2_checkpoint_loads_into_megatron_bitwise(from_fsdp2, dst) -> None:  # type: ignore[no-untyped-def]
    load_and_compare(from_fsdp2, dst)


def test_the_stored_chunks_are_plain_canonical_boxes(from_megatron) -> None:  # type: ignore[no-untyped-def]
    """The HF export of a Megatron checkpoint is the canonical truth, bitwise."""
    out = from_megatron.parent / "hf"
    export_hf(from_megatron, out)
    with HfCheckpoint(out) as hf:
        hf.check(SPEC)
        for name, want in TRUTH["param"].items():
            assert torch.equal(bits(hf.read_full(name)), bits(want)), name


def test_a_non_blocking_save_copies_the_strided_pieces(tmp_path: Path) -> None:
    load_and_compare(save(tmp_path / "copy", "megatron:d2e2", blocking=False), "fsdp:d2")
