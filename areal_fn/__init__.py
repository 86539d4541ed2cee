"""areal_fn: the distributed-training core of LLM RL systems as pure functions."""

from .errors import CheckpointError as CheckpointError
from .errors import ConversionError as ConversionError
from .errors import LayoutError as LayoutError
from .errors import ParseError as ParseError
from .errors import PlanError as PlanError
from .errors import SpecError as SpecError
from .tensor_spec import TensorSpec as TensorSpec

__version__ = "0.1.0"
