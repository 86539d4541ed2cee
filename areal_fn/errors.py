"""Error types of areal_fn.

Every error raised for bad user input is a :class:`SpecError` (a ``ValueError``).
Messages follow one shape: what is wrong, which field/value, the rule, the remedy.
"""


class SpecError(ValueError):
    """Base class: an input violates a rule of the specification."""


class ParseError(SpecError):
    """A strategy/allocation string does not follow the grammar."""


class LayoutError(SpecError):
    """A model cannot be laid out under a strategy (divisibility, ranges)."""


class ConversionError(SpecError):
    """Tensors do not match what a conversion expects (missing, extra, shape)."""


class PlanError(SpecError):
    """A plan (pipeline partition, transfer plan, buckets) cannot be made."""


class CheckpointError(SpecError):
    """A checkpoint is missing, corrupted, or belongs to something else."""


class UnsupportedConfigError(SpecError):
    """A ``config.json`` asks for a computation its model family does not model.

    An activation, sliding-window attention, a rope type or partial rotary embeddings
    that the family (and the engines built from it) would not apply: refused, never
    ignored.
    """
