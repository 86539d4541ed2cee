"""The picture files of ``areal-fn plan --png DIR``: one PNG per kind and component.

- ``<component>.ranks.png``: the rank grid (:func:`~.figures.rank_grid_figure`);
- ``<component>.stages.png``: parameters per pipeline chunk
  (:func:`~.figures.stage_loads_figure`), for components with pipeline stages.

``<component>`` is the component's string with ``:`` as ``-``, ``|`` as ``_`` and no
parentheses (``megatron-d2p2t2``, ``sglang[roll]-d1t2``).
"""

from pathlib import Path
from typing import TYPE_CHECKING

from areal_fn.layouts.layout import Layout
from areal_fn.model.spec import ModelSpec
from areal_fn.runtime.pictures.data import rank_grid_of, stage_loads_of
from areal_fn.runtime.pictures.figures import (
    rank_grid_figure,
    require_matplotlib,
    stage_loads_figure,
)
from areal_fn.strategy.allocation import Component
from areal_fn.typecheck import beartype

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["file_stem", "plan_pictures", "save_png"]


def file_stem(component: Component) -> str:
    """``megatron:(attn:d2t2|ffn:e2t2)`` -> ``megatron-attn-d2t2_ffn-e2t2``."""
    return str(component).replace(":", "-").replace("|", "_").replace("(", "").replace(")", "")


def save_png(fig: "Figure", path: Path) -> Path:
    """Write ``fig`` as a PNG of exactly its size in pixels (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=fig.dpi, metadata={"Software": None})
    return path


@beartype
def plan_pictures(
    model_name: str,
    model: ModelSpec,
    component: Component,
    layout: Layout,
    out: Path,
    *,
    first_rank: int = 0,
) -> tuple[Path, ...]:
    """Write ``component``'s pictures into ``out``; the paths written, in order.

    ``first_rank``: the component's first global rank in its allocation, so the
    pictures number ranks as ``areal-fn plan`` prints them.
    """
    require_matplotlib()
    stem = file_stem(component)
    grid = rank_grid_of(model_name, model, component, layout, first_rank=first_rank)
    paths = [save_png(rank_grid_figure(grid), out / f"{stem}.ranks.png")]
    loads = stage_loads_of(model_name, model, component, layout)
    if loads is not None:
        paths.append(save_png(stage_loads_figure(loads), out / f"{stem}.stages.png"))
    return tuple(paths)
