"""Public hypothesis strategies for areal_fn records (needs the `testing` extra).

Every strategy is valid by construction (divisors are drawn, not filtered) and
shrinks towards small meshes, small shapes and simple placements.
"""

from .allocation import allocations as allocations
from .allocation import component_names as component_names
from .allocation import components as components
from .allocation import parallel_dims as parallel_dims
from .core import meshes as meshes
from .core import placements as placements
from .core import shapes as shapes
from .core import sharded_shapes as sharded_shapes
from .core import shardings as shardings
from .core import tensors as tensors
from .layouts import fused_layouts as fused_layouts
from .layouts import layout_pairs as layout_pairs
from .models import hf_configs as hf_configs
from .models import model_specs as model_specs
from .pipeline import layer_costs as layer_costs
from .pipeline import pipeline_problems as pipeline_problems
from .pipeline import stage_plans as stage_plans
