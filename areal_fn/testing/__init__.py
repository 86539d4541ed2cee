"""Public hypothesis strategies for areal_fn records (needs the `testing` extra).

Every strategy is valid by construction (divisors are drawn, not filtered) and
shrinks towards small meshes, small shapes and simple placements.
"""

from areal_fn.testing.allocation import allocations as allocations
from areal_fn.testing.allocation import component_names as component_names
from areal_fn.testing.allocation import components as components
from areal_fn.testing.allocation import parallel_dims as parallel_dims
from areal_fn.testing.core import meshes as meshes
from areal_fn.testing.core import placements as placements
from areal_fn.testing.core import shapes as shapes
from areal_fn.testing.core import sharded_shapes as sharded_shapes
from areal_fn.testing.core import shardings as shardings
from areal_fn.testing.core import tensors as tensors
from areal_fn.testing.layouts import fused_layouts as fused_layouts
from areal_fn.testing.layouts import layout_pairs as layout_pairs
from areal_fn.testing.models import hf_configs as hf_configs
from areal_fn.testing.models import model_specs as model_specs
from areal_fn.testing.pipeline import layer_costs as layer_costs
from areal_fn.testing.pipeline import pipeline_problems as pipeline_problems
from areal_fn.testing.pipeline import stage_plans as stage_plans
