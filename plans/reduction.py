"""The gradient-reduction policy: how a gradient crosses the mesh axes that replicate it.

A parameter replicated over some mesh axes has, after backward, a partial gradient on
each device there; the devices must sum it. ``GradReduction`` decides how, for every
parameter group the runtime sums together (a DDP bucket, a ZeRO bucket's all-reduced
part, an FSDP group's reduce-scatter):

- **form**, over several axes: ``per_axis`` all-reduces the bucket over each axis in turn
  (each call on the whole bucket); ``hierarchical`` reduce-scatters over the fastest axes
  first, all-reduces what is left over the slowest, and all-gathers back (Horovod's and
  Tencent's hierarchical all-reduce; Mikami et al. 2018's 2-D torus all-reduce is the
  two-axis case). With axes of sizes ``n_1 .. n_k`` (fastest first) and a bucket of
  ``S`` bytes the hierarchical form sends

      sum_{i<k} 2 (n_i - 1)/n_i * S / (n_1 ... n_{i-1})  +  2 (n_k - 1)/n_k * S / (n_1 ... n_{k-1})

  bytes per device, against ``sum_i 2 (n_i - 1)/n_i * S`` for ``per_axis``: the slow axis
  carries ``1 / (n_1 ... n_{k-1})`` of the bytes. ``hierarchical_steps`` lists the calls;
  the runtime (``autopar.runtime.reduction``) runs that list and the ledger
  (``autopar_passes.ledger``) records it, so the two cannot differ. ``auto`` is resolved at
  planning time to the cheaper of the two under the cost model.
- **dtype**: under mixed precision the compute dtype (FSDP2's ``reduce_dtype``); a casting
  compression (``bf16``, ``fp16``) makes it 16 bits under fp32 as well.
- **compression** (``autopar_plans.compression``): opt-in, since it changes the numbers.
  It applies where a gradient is all-reduced (the data-parallel buckets); a gradient that
  ZeRO or FSDP reduce-scatters is summed in full.
- **when**: ``every_step``, or ``local_sgd``: after ``warmup`` synchronous steps, no
  gradient crosses the axes; every ``period`` optimizer steps the parameters are averaged
  instead (post-local SGD, Lin et al. 2020, arXiv 1808.07217; torch's
  ``PeriodicModelAverager``), one all-reduce of the parameters a ``period``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from autopar_plans.compression import GradCompression

Form = Literal["auto", "per_axis", "hierarchical"]
Sync = Literal["every_step", "local_sgd"]


class GradReduction(BaseModel):
    """The gradient-reduction policy of a plan (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    form: Form = "auto"
    compression: GradCompression = GradCompression()
    sync: Sync = "every_step"
    period: int = Field(1, ge=1, description="local_sgd: optimizer steps between averagings.")
    warmup: int = Field(
        0, ge=0, description="local_sgd: synchronous steps before the local ones start."
    )
    axis_order: tuple[str, ...] = Field(
        (),
        description="The mesh axes fastest link first, as the hierarchical form uses them "
        "(set at planning time).",
    )

    def order(self, axes: Sequence[str]) -> list[str]:
        """``axes`` fastest first (``axis_order``; axes it does not name keep their
        order, last mesh axis first, as the cost model breaks ties)."""
        rank = {name: i for i, name in enumerate(self.axis_order)}
        return sorted(axes, key=lambda a: (rank.get(a, len(rank)), -list(axes).index(a)))

    def hierarchical(self, axes: Sequence[str]) -> bool:
        """Whether a sum over ``axes`` takes the hierarchical form."""
        return self.form == "hierarchical" and len(axes) > 1

    def wire_dtype(self, dtype: str, compute: str | None) -> str:
        """The dtype a floating-point gradient stored in ``dtype`` is summed in:
        ``compute`` (mixed precision's compute dtype) or a casting scheme's dtype."""
        if not dtype.startswith(("float", "bfloat")):
            return dtype
        cast = self.compression.cast_dtype
        if cast is not None and _itemsize(cast) < _itemsize(compute or dtype):
            return cast
        return compute or dtype

    def syncs_every_step(self, step: int) -> bool:
        """Whether the gradients are summed at optimizer step ``step`` (from 0)."""
        return self.sync == "every_step" or step < self.warmup

    def averages_after(self, step: int) -> bool:
        """Whether local SGD averages the parameters after optimizer step ``step`` (from 0)."""
        if self.sync != "local_sgd" or step < self.warmup:
            return False
        return (step - self.warmup + 1) % self.period == 0


class ReduceStep(NamedTuple):
    """One collective of a gradient sum: ``kind`` over the axis ``axis`` on a piece of
    ``1 / divisor`` of the (padded) bucket."""

    kind: str
    axis: str
    divisor: int


def hierarchical_steps(sizes: Sequence[tuple[str, int]]) -> list[ReduceStep]:
    """The calls of the hierarchical all-reduce over axes ``(name, size)`` fastest first:
    reduce-scatter over each but the last (the piece shrinking), all-reduce over the last,
    all-gather back in reverse order."""
    down, divisor = [], 1
    for name, size in sizes[:-1]:
        down.append(ReduceStep("reduce_scatter", name, divisor))
        divisor *= size
    middle = ReduceStep("all_reduce", sizes[-1][0], divisor)
    up = [ReduceStep("all_gather", step.axis, step.divisor) for step in reversed(down)]
    return [*down, middle, *up]


def reduce_steps(policy: GradReduction, sizes: Sequence[tuple[str, int]]) -> list[ReduceStep]:
    """The calls that sum a bucket over axes ``(name, size)`` (in the bucket's own order)
    under ``policy``: one all-reduce per axis, or the hierarchical form, fastest first."""
    live = [(name, size) for name, size in sizes if size > 1]
    if policy.hierarchical([name for name, _ in live]):
        by_name = dict(live)
        return hierarchical_steps([(a, by_name[a]) for a in policy.order(list(by_name))])
    return [ReduceStep("all_reduce", name, 1) for name, _ in live]


def padded_numel(numel: int, steps: Sequence[ReduceStep], sizes: Sequence[tuple[str, int]]) -> int:
    """A bucket's length once padded so every reduce-scatter of ``steps`` splits it evenly."""
    by_name = dict(sizes)
    multiple = math.prod(by_name[s.axis] for s in steps if s.kind == "reduce_scatter")
    return -(-numel // multiple) * multiple


def _itemsize(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)


# what ran before the policy existed, and what a plan file without one runs: one
# all-reduce per axis, every step, uncompressed
PER_AXIS = GradReduction(form="per_axis")
