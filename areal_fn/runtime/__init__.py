"""The impure shell of areal_fn: process groups, Megatron-Core models, launches.

Modules here perform effects (``torch.distributed``, files, environment). Nothing is
imported eagerly: import the submodule you need, e.g.
``from areal_fn.runtime.megatron import cpu``.
"""
