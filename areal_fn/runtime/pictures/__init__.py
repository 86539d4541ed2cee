"""Pictures of a plan (``areal-fn plan --png DIR``): a rank grid and the pipeline's
parameters per chunk, as matplotlib figures and PNG files.

:mod:`~.data` computes what they show (no plotting library), :mod:`~.figures` draws
it (matplotlib, the optional ``pictures`` extra), :mod:`~.files` writes the PNGs.
"""

from areal_fn.runtime.pictures.data import GridCell as GridCell
from areal_fn.runtime.pictures.data import RankGrid as RankGrid
from areal_fn.runtime.pictures.data import StageLoads as StageLoads
from areal_fn.runtime.pictures.data import rank_grid_of as rank_grid_of
from areal_fn.runtime.pictures.data import stage_loads_of as stage_loads_of
from areal_fn.runtime.pictures.figures import MISSING_MATPLOTLIB as MISSING_MATPLOTLIB
from areal_fn.runtime.pictures.figures import rank_grid_figure as rank_grid_figure
from areal_fn.runtime.pictures.figures import require_matplotlib as require_matplotlib
from areal_fn.runtime.pictures.figures import stage_colors as stage_colors
from areal_fn.runtime.pictures.figures import stage_loads_figure as stage_loads_figure
from areal_fn.runtime.pictures.files import file_stem as file_stem
from areal_fn.runtime.pictures.files import plan_pictures as plan_pictures
from areal_fn.runtime.pictures.files import save_png as save_png
