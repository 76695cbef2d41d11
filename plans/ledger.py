"""The communication ledger: every collective a training step issues, as the plan promises it.

One ``CommEntry`` per collective site: its kind, mesh axes, dtype, bytes per call, calls per
step, the phase it runs in, and what hides it. The plan's communication figures
(``Estimate.comm_bytes_per_step``, ``comm_s``, ``exposed_comm_s``) are sums over it, and the
runtime records what it really issues in the same terms (``autopar.runtime.comm``), so a
test can hold one against the other: ``tally`` of both must agree, call for call and byte
for byte, per (kind, axes, dtype).

Bytes per call are the payload as ``autopar_cost_model.reshard`` prices it: the whole array of an
all-gather (its output) and of a reduce-scatter (its input), the tensor of an all-reduce or
a broadcast, each device's buffer of an all-to-all. What a device *sends* follows from the
kind and the group's size (``sent``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

Phase = Literal["forward", "backward", "step"]
Overlap = Literal["none", "backward", "compute"]

CommKey = tuple[str, tuple[str, ...], str]  # (kind, mesh axes, dtype)


class CommCount(NamedTuple):
    calls: int
    nbytes: float


class CommEntry(BaseModel):
    """One collective site of a step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(
        description="all_gather, reduce_scatter, all_reduce, all_to_all, broadcast; a "
        "pipeline's send and recv."
    )
    axes: tuple[str, ...] = Field(description="The mesh axes its group spans.")
    dtype: str
    bytes_per_call: float = Field(description="Payload per call (module docstring).")
    calls_per_step: int = Field(ge=0)
    phase: Phase = Field(
        description="forward or backward (of every microbatch; calls_per_step counts them "
        "all), or step: once per optimizer step, outside the microbatches' passes."
    )
    what: str = Field(description="Why it runs: the reshard, bucket or group it serves.")
    overlap: Overlap = Field(
        "none", description="What may hide it: nothing, the backward pass, or compute."
    )
    time_s: float = Field(0.0, description="Its time per step, all calls.")
    exposed_s: float = Field(0.0, description="The part of time_s compute does not hide.")
    sent_per_call: float = Field(0.0, description="Bytes a device sends per call.")
    stage: int = 0
    period: int = Field(
        1,
        ge=1,
        description="It runs in one optimizer step of every `period` (local SGD's "
        "averaging): time_s, exposed_s and the per-step figures are averages over them.",
    )

    @property
    def key(self) -> CommKey:
        return (self.kind, self.axes, self.dtype)

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_call * self.calls_per_step / self.period

    @property
    def sent_per_step(self) -> float:
        return self.sent_per_call * self.calls_per_step / self.period

    def calls_over(self, steps: int) -> int:
        """Calls over ``steps`` optimizer steps from the first (a multiple of ``period``)."""
        return self.calls_per_step * (steps // self.period)


def sent(kind: str, nbytes: float, devices: int) -> float:
    """Bytes a device sends for one call of ``kind`` with payload ``nbytes`` over
    ``devices`` (ring algorithms; nccl-tests' bus factors)."""
    if devices <= 1:
        return 0.0
    share = (devices - 1) / devices
    if kind == "all_reduce":
        return 2 * share * nbytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return share * nbytes  # all-to-all: it keeps 1/n of its own buffer
    if kind == "recv":
        return 0.0  # its sender counts it
    return nbytes  # broadcast, send: the payload once


def tally(rows: Iterable[tuple[str, tuple[str, ...], str, int, float]]) -> dict[CommKey, CommCount]:
    """Calls and bytes per (kind, axes, dtype) of ``(kind, axes, dtype, calls, bytes)`` rows."""
    out: dict[CommKey, CommCount] = {}
    for kind, axes, dtype, calls, nbytes in rows:
        if not calls:
            continue
        key = (kind, tuple(axes), dtype)
        before = out.get(key, CommCount(0, 0.0))
        out[key] = CommCount(before.calls + calls, before.nbytes + nbytes)
    return out


def tally_entries(entries: Iterable[CommEntry], steps: int = 1) -> dict[CommKey, CommCount]:
    """``tally`` of a ledger over ``steps`` optimizer steps."""
    return tally(
        (e.kind, e.axes, e.dtype, e.calls_over(steps), e.calls_over(steps) * e.bytes_per_call)
        for e in entries
    )
