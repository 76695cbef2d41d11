"""Helpers for running autopar on several local processes (tests, demo, benchmarks).

``run_ranks(work, world_size, args)`` runs ``work(rank, world_size, *args)`` on that many
local processes joined by a gloo process group and returns their results in rank order.
"""

from autopar.testing.ranks import run_ranks

__all__ = ["run_ranks"]
