"""Fit a preset's ``in_step`` to the reference step ``autopar calibrate`` timed.

The cost model predicts the reference step (``cost_model.reference_step``) as every traced
op's forward and backward (``CostModel.op_time``) on one device: host time ``H`` per op
plus roofline time ``R``, which ``in_step`` scales. Predicted at ``in_step`` 1 and 2 the
two terms come apart (``P(f) = H + f R``), and the measured seconds ``T`` give
``in_step = (T - H) / R``.
"""

from __future__ import annotations

import torch

from cost_model.collectives import MeshCost
from cost_model.hardware import DevicePreset
from cost_model.reference_step import reference_step
from passes.annotation import META_KEY
from passes.costs import CostModel
from passes.strategies.types import Strategy
from passes.trace import trace
from plans.mesh import MeshSpec

WHOLE = Strategy((), (), 1)  # one device: every op does all of its work


def predicted_reference_s(preset: DevicePreset) -> float:
    """The cost model's forward and backward seconds of the reference step on ``preset``."""
    model, x = reference_step(torch.device("meta"))
    traced = trace(model, (x.requires_grad_(),))
    cost = CostModel(MeshCost(MeshSpec((1,), ("x",)), preset))
    total = 0.0
    for node in traced.graph.nodes:
        note = node.meta.get(META_KEY)
        if node.op == "call_function" and note is not None and note.kind in ("op", "view"):
            total += sum(cost.op_time(note, WHOLE))
    return total


def fit_in_step(preset: DevicePreset, measured_s: float) -> float:
    """The ``in_step`` at which the cost model predicts the reference step in ``measured_s``."""
    once = predicted_reference_s(preset.model_copy(update={"in_step": 1.0}))
    twice = predicted_reference_s(preset.model_copy(update={"in_step": 2.0}))
    roofline, host = twice - once, 2 * once - twice
    return max(measured_s - host, 0.0) / roofline if roofline > 0 else 1.0
