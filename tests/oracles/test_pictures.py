"""The pictures of ``areal-fn plan --png``: titled, labelled figures with a legend, global
rank numbers, values on the stage-load bars, one colour per stage in both pictures,
and a bounded summary for large worlds.

The figures are inspected as matplotlib objects before they are saved (titles, labels,
legend entries, the patches and texts found by their ``gid``); the files are read back
with PIL and matplotlib. Expected values are literals: the ranks the CLI prints for a
component, Megatron's rank order (``tp-cp-ep-dp-pp``: the pipeline stage varies
slowest), the published parameter count of Qwen2.5-7B.
"""

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from PIL import Image

from areal_fn import model_from_hf_config, parse_allocation
from areal_fn.errors import SpecError
from areal_fn.layouts.layout_for import layout_for
from areal_fn.runtime.pictures import (
    plan_pictures,
    rank_grid_figure,
    rank_grid_of,
    require_matplotlib,
    stage_loads_figure,
    stage_loads_of,
)

EXE = Path(sys.executable).with_name("areal-fn")
QWEN = model_from_hf_config("Qwen2.5-7B")
#: Qwen2.5-7B's parameters as its model card counts them (untied embeddings)
QWEN_PARAMS = 7_615_616_512
#: no picture may be wider or taller than this (pixels)
MAX_W, MAX_H = 1700, 1200


def _component(allocation: str, index: int = -1):
    alloc = parse_allocation(allocation)
    comp = alloc.components[index]
    return comp, layout_for(QWEN, comp), alloc.rank_range(comp).start


def _by_gid(fig, prefix: str) -> dict[str, object]:
    found = fig.findobj(lambda a: (a.get_gid() or "").startswith(prefix))
    return {a.get_gid()[len(prefix) :]: a for a in found}


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def _pixels(fig) -> tuple[float, float]:
    w, h = fig.get_size_inches()
    return w * fig.dpi, h * fig.dpi


def test_rank_grid_numbers_global_ranks_and_colours_stages():
    comp, layout, first = _component("sglang:d2t4+megatron:d2p2t2")
    fig = rank_grid_figure(rank_grid_of("Qwen2.5-7B", QWEN, comp, layout, first_rank=first))
    (ax,) = fig.axes
    assert fig.get_suptitle() == "Qwen2.5-7B under megatron:d2p2t2: ranks 8-15"
    assert ax.get_xlabel() == "column: index over dp x cp x tp (tp fastest)"
    assert ax.get_ylabel() == "row: pp"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["pp=0", "pp=1"]
    assert "Mesh(pp=2, dp=2, cp=1, tp=2)" in ax.get_title()
    assert _legend_labels(fig) == ["stage 0", "stage 1"]
    labels = _by_gid(fig, "label:")
    assert sorted(labels, key=int) == [str(r) for r in range(8, 16)]
    # every rank holds Qwen2.5-7B's weights split 4 ways (tp=2, pp=2): about 3.5 GiB
    assert all(t.get_text().split("\n")[1] == "3.5 GiB" for t in labels.values())
    cells = _by_gid(fig, "ranks:")
    legend = {
        t.get_text(): h
        for lg in fig.legends
        for t, h in zip(lg.get_texts(), lg.legend_handles, strict=True)
    }
    for r in range(8, 16):
        stage = (r - 8) // 4  # Megatron's order: dp*cp*tp = 4 ranks per stage
        assert cells[str(r)].get_facecolor() == legend[f"stage {stage}"].get_facecolor()
    w, h = _pixels(fig)
    assert 600 <= w <= MAX_W and 250 <= h <= MAX_H


def test_stage_loads_bars_carry_their_values_and_the_stage_colours():
    comp, layout, _ = _component("megatron:d2p2t2v2")
    loads = stage_loads_of("Qwen2.5-7B", QWEN, comp, layout)
    fig = stage_loads_figure(loads)
    (ax,) = fig.axes
    bars = _by_gid(fig, "chunk:")
    assert sorted(bars, key=int) == ["0", "1", "2", "3"]
    heights = [bars[str(j)].get_height() for j in range(4)]
    assert sum(heights) == QWEN_PARAMS
    assert fig.get_suptitle() == "Qwen2.5-7B under megatron:d2p2t2v2: parameters per pipeline chunk"
    assert ax.get_ylabel() == "params" and ax.get_xlabel().startswith(
        "pipeline chunk in layer order"
    )
    # 28 layers in 2 x 2 chunks of 7 (Megatron's default split)
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{j}\n7 layers" for j in range(4)]
    # each bar has its value above it, e.g. "2.05G", within the label's three digits
    values = [t for t in ax.texts if t.get_text()[-1:] in "GM"]
    assert len(values) == 4
    for text, height in zip(values, heights, strict=True):
        scale = {"G": 1e9, "M": 1e6}[text.get_text()[-1]]
        assert float(text.get_text()[:-1]) * scale == pytest.approx(height, rel=5e-3)
    labels = _legend_labels(fig)
    assert labels[:4] == ["stage 0", "stage 1", "virtual stage 0", "virtual stage 1"]
    assert labels[4].startswith("mean ")
    # chunk j runs on stage j % pp: the same colour as that stage's ranks in the grid
    grid = rank_grid_figure(rank_grid_of("Qwen2.5-7B", QWEN, comp, layout))
    cells = _by_gid(grid, "ranks:")
    for j in range(4):
        stage_rank = (j % 2) * 4  # the first rank of stage j % 2 (dp*cp*tp = 4)
        assert bars[str(j)].get_facecolor() == cells[str(stage_rank)].get_facecolor()
    assert [bars[str(j)].get_hatch() or "" for j in range(4)] == ["", "", "//", "//"]


def test_a_4096_rank_plan_gives_a_bounded_summary(tmp_path):
    comp, layout, _ = _component("megatron:d512p2t4")
    grid = rank_grid_of("Qwen2.5-7B", QWEN, comp, layout)
    fig = rank_grid_figure(grid)
    w, h = _pixels(fig)
    assert w <= MAX_W and h <= MAX_H
    cells = _by_gid(fig, "ranks:")
    assert len(cells) == 2 * 16  # pp=2 rows; 2048 columns in 16 blocks of 128
    assert "0-127" in cells and "3968-4095" in cells
    covered = sorted(r for cell in grid.cells for r in cell.ranks)
    assert covered == list(range(4096))
    assert "each cell: up to 128 ranks" in fig.axes[0].get_title()
    (ranks_png, stages_png) = plan_pictures("Qwen2.5-7B", QWEN, comp, layout, tmp_path)
    with Image.open(ranks_png) as im:
        assert im.format == "PNG" and im.size[0] <= MAX_W and im.size[1] <= MAX_H
    assert matplotlib.image.imread(stages_png).shape[2] in (3, 4)


@pytest.mark.parametrize(
    ("allocation", "rows", "cols", "row_axis"),
    [
        ("fsdp:d8", 1, 8, ""),  # a 1-D mesh lies across
        ("fsdp:d4t2", 4, 2, "dp_shard"),
        ("sglang:d2p2t2", 2, 4, "dp"),
        ("megatron:d32p28", 14, 16, "pp"),  # both directions summarised
    ],
)
def test_every_rank_is_in_exactly_one_cell_of_a_bounded_grid(allocation, rows, cols, row_axis):
    comp, layout, _ = _component(allocation)
    grid = rank_grid_of("Qwen2.5-7B", QWEN, comp, layout)
    assert (grid.rows, grid.cols, grid.row_axis) == (rows, cols, row_axis)
    assert sorted(r for c in grid.cells for r in c.ranks) == list(range(layout.world_size))
    fig = rank_grid_figure(grid)
    w, h = _pixels(fig)
    assert w <= MAX_W and h <= MAX_H
    assert len(_by_gid(fig, "ranks:")) == rows * cols


def test_summarised_stage_rows_name_their_stages_and_ranks():
    comp, layout, _ = _component("megatron:d32p28")  # 28 stages in 14 rows of two
    fig = rank_grid_figure(rank_grid_of("Qwen2.5-7B", QWEN, comp, layout))
    assert _legend_labels(fig) == [f"stages {2 * i}-{2 * i + 1}" for i in range(14)]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][:2] == ["pp=0-1", "pp=2-3"]
    # Megatron's order with dp=32, tp=cp=1: rank = 32 * pp + dp; the first cell holds
    # pp 0-1 x dp 0-1
    labels = _by_gid(fig, "label:")
    assert "0-1, 32-33" in labels and "862-863, 894-895" in labels
    assert "several stages" in fig.axes[0].get_title()


def test_bad_grid_limits_are_refused():
    comp, layout, _ = _component("fsdp:d8")
    with pytest.raises(SpecError, match=r"rank_grid_of: max_cols=0 must be >= 1"):
        rank_grid_of("m", QWEN, comp, layout, max_cols=0)


def test_without_matplotlib_the_library_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(
        ModuleNotFoundError,
        match=r"^pictures need matplotlib, .*pip install 'areal-fn\[pictures\]'",
    ):
        require_matplotlib()


def test_cli_writes_one_readable_png_per_kind(tmp_path):
    out = tmp_path / "pics"
    run = subprocess.run(
        [str(EXE), "plan", "Qwen2.5-7B", "sglang:d2t4+megatron:d2p2t2", "--png", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    printed = [line for line in run.stdout.splitlines() if line.startswith("pictures: ")]
    paths = [Path(p) for line in printed for p in line[len("pictures: ") :].split(", ")]
    assert sorted(p.name for p in paths) == [
        "megatron-d2p2t2.ranks.png",
        "megatron-d2p2t2.stages.png",
        "sglang-d2t4.ranks.png",
    ]
    assert sorted(out.iterdir()) == sorted(paths)
    for p in paths:
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            assert im.format == "PNG" and 600 <= im.size[0] <= MAX_W and 250 <= im.size[1] <= MAX_H
        assert matplotlib.image.imread(p).ndim == 3


def test_cli_without_matplotlib_is_a_one_line_error(tmp_path):
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    run = subprocess.run(
        [str(EXE), "plan", "Qwen2.5-7B", "megatron:d2p2t2", "--png", str(tmp_path / "p")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(shim.parent)},
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (
        "areal-fn: error: --png: pictures need matplotlib, which is not installed; install "
        "the pictures extra: pip install 'areal-fn[pictures]' (or pip install matplotlib)\n"
    )
    assert not (tmp_path / "p").exists()
