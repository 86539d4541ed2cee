"""Public hypothesis strategies for areal_fn records (needs the `testing` extra).

Every strategy is valid by construction (divisors are drawn, not filtered) and
shrinks towards small meshes, small shapes and simple placements.
"""

from .core import meshes as meshes
from .core import placements as placements
from .core import sharded_shapes as sharded_shapes
from .core import shardings as shardings
from .core import shapes as shapes
from .core import tensors as tensors
