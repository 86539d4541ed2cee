"""Public hypothesis strategies for areal_fn records (needs the `testing` extra).

Every strategy is valid by construction (divisors are drawn, not filtered) and
shrinks towards small meshes, small shapes and simple placements.
"""
