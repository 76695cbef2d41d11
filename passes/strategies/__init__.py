"""Per-op sharding strategies: the rule table, the einsum generator, the brute-force check.

``rules()`` maps each ATen op to its rule; an op without one is replicated (see
``autopar_passes.strategies.graph``) with a warning that names it.
"""
