"""A flat bucket summed over its mesh axes, in the form the plan's policy chose.

``autopar_plans.reduction.reduce_steps`` lists the calls (one all-reduce per axis, or the
hierarchical form: reduce-scatter over the fast axes, all-reduce over the slowest,
all-gather back); ``BucketSum`` runs that list, so what runs is what the ledger records.
The first call starts at once, without waiting, so that it overlaps the rest of backward
(as DDP's buckets); ``wait`` runs the others and returns the sum.

The bucket is padded with zeros to a multiple of the reduce-scatters' sizes, so every
device's piece is the same size; the padding travels (the ledger counts it) and is cut off
at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from autopar.runtime.collectives import all_gather_rows, start_reduce_scatter_rows
from autopar.runtime.comm import AxisGroup
from autopar_plans.reduction import GradReduction, ReduceStep, padded_numel, reduce_steps


def steps_for(policy: GradReduction, groups: Sequence[AxisGroup]) -> list[ReduceStep]:
    """The calls that sum over ``groups`` (one mesh axis each) under ``policy``."""
    return reduce_steps(policy, [(g.axes[0], g.size) for g in groups])


class BucketSum:
    """The sum of a 1-D ``flat`` over ``groups`` by ``steps``, the first call launched now."""

    def __init__(
        self, flat: torch.Tensor, steps: Sequence[ReduceStep], groups: Sequence[AxisGroup]
    ) -> None:
        self.numel = flat.numel()
        self._groups: Mapping[str, AxisGroup] = {g.axes[0]: g for g in groups}
        self._steps = list(steps)
        sizes = [(name, g.size) for name, g in self._groups.items()]
        padded = padded_numel(self.numel, self._steps, sizes)
        if padded != self.numel:
            flat = torch.cat([flat, flat.new_zeros(padded - self.numel)])
        self._value = flat
        self._work: Any = None
        self._result: Callable[[], torch.Tensor] | None = None
        if self._steps:
            self._start(self._steps[0])

    def _start(self, step: ReduceStep) -> None:
        group = self._groups[step.axis]
        if step.kind == "all_reduce":
            self._work = group.all_reduce(self._value, async_op=True)
            value = self._value
            self._result = lambda: value
        elif step.kind == "reduce_scatter":
            rows = self._value.view(group.size, -1)
            self._work, self._result = start_reduce_scatter_rows(rows, group)
        else:  # an all-gather never comes first
            raise AssertionError(f"a sum cannot start with {step.kind}")

    def wait(self) -> torch.Tensor:
        """The summed bucket, its length as given."""
        if self._steps:
            self._work.wait()
            assert self._result is not None
            value = self._result()
            for step in self._steps[1:]:
                value = self._run(step, value)
            self._value = value
        return self._value[: self.numel]

    def _run(self, step: ReduceStep, value: torch.Tensor) -> torch.Tensor:
        group = self._groups[step.axis]
        if step.kind == "all_reduce":
            group.all_reduce(value)
            return value
        if step.kind == "reduce_scatter":
            work, result = start_reduce_scatter_rows(value.view(group.size, -1), group)
            work.wait()
            return result()
        return all_gather_rows(value, group).reshape(-1)


def sum_flat(
    flat: torch.Tensor, policy: GradReduction, groups: Sequence[AxisGroup]
) -> torch.Tensor:
    """``flat`` summed over ``groups`` under ``policy``, waiting for it."""
    return BucketSum(flat, steps_for(policy, groups), groups).wait()
