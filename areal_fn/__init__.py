"""areal_fn: the distributed-training core of LLM RL systems as pure functions."""

from .box import Box as Box
from .errors import CheckpointError as CheckpointError
from .errors import ConversionError as ConversionError
from .errors import LayoutError as LayoutError
from .errors import ParseError as ParseError
from .errors import PlanError as PlanError
from .errors import SpecError as SpecError
from .mesh import Mesh as Mesh
from .partition_spec import PartitionSpec as PartitionSpec
from .partition_spec import from_partition_spec as from_partition_spec
from .partition_spec import to_partition_spec as to_partition_spec
from .placement import Partial as Partial
from .placement import Replicate as Replicate
from .placement import Shard as Shard
from .placement import StridedShard as StridedShard
from .shard import shard as shard
from .shard import unshard as unshard
from .sharding import Sharding as Sharding
from .sharding import check_sharding as check_sharding
from .sharding import local_boxes as local_boxes
from .sharding import local_pieces as local_pieces
from .sharding import local_shape as local_shape
from .tensor_spec import TensorSpec as TensorSpec

__version__ = "0.1.0"
