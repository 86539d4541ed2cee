"""`Mixer`: which token mixer a decoder layer has, a per-layer kind of the family tables
(:mod:`areal_fn.model.families.mapping`) beside the MLP kind ``LayerKind``."""

import enum


class Mixer(enum.Enum):
    """Which token mixer a layer holding a record has (``layer_types``: Qwen3-Next, Qwen3.5)."""

    ANY = "any"
    #: Softmax attention over the context (``full_attention``).
    ATTENTION = "attention"
    #: Gated-delta-net linear attention (``linear_attention``): a recurrent state per head.
    LINEAR = "linear"

    def __repr__(self) -> str:
        return f"Mixer.{self.name}"
