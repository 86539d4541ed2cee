"""The check both quantised-checkpoint oracles make: a quantised HF checkpoint converts
and loads exactly as its dequantised copy does."""

from pathlib import Path

from areal_fn import ParallelDims, megatron_layout, model_from_hf_config
from areal_fn.layouts.fsdp2 import fsdp2_layout
from areal_fn.layouts.layout import Layout
from areal_fn.runtime.hf.convert import convert_to_local, rank_file, read_local
from areal_fn.runtime.hf.load_into import load_into
from tests.laws.test_convert_into import assert_bitwise, poisoned_like


def check_reads_as_plain(
    quantised: Path, plain: Path, alloc: str, tmp_path: Path
) -> tuple[Layout, list[tuple[int, int]]]:
    """``convert_to_local`` of ``quantised`` equals that of ``plain`` (its dequantised
    copy) on every rank of ``alloc`` (``megatron:t2`` or ``fsdp:d2t2``), bitwise, and
    ``load_into`` of ``quantised`` fills each rank's tensors with the same bytes; per
    rank, the bytes ``load_into`` reported and the bytes of the rank's tensors (with the
    layout; the rank files are ``tmp_path / "a"``)."""
    spec = model_from_hf_config(quantised)
    convert_to_local(quantised, alloc, tmp_path / "a")
    convert_to_local(plain, alloc, tmp_path / "b")
    layout = (
        megatron_layout(spec, ParallelDims(tp=2))
        if alloc.startswith("megatron")
        else fsdp2_layout(spec, ParallelDims(dp=2, tp=2))
    )
    loaded = []
    for rank in range(layout.world_size):
        a = read_local(tmp_path / "a" / rank_file(rank))
        assert_bitwise(a, read_local(tmp_path / "b" / rank_file(rank)))
        out = poisoned_like(a)
        loaded.append(
            (load_into(quantised, layout, rank, out=out), sum(t.nbytes for t in a.values()))
        )
        assert_bitwise(out, a)
    return layout, loaded
