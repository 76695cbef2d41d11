"""Fit a preset's ``in_step`` to the reference step ``autopar calibrate`` timed.

The cost model predicts the reference step (``autopar_cost_model.reference_step``) as every traced
op's forward and backward (``CostModel.op_time``) on one device: host time ``H`` per op
plus roofline time ``R``, which ``in_step`` scales. Predicted at ``in_step`` 1 and 2 the
two terms come apart (``P(f) = H + f R``), and the measured seconds ``T`` give
``in_step = (T - H) / R``.
"""

from __future__ import annotations

import torch

from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.hardware import DevicePreset
from autopar_cost_model.reference_step import reference_step
from autopar_passes.annotation import META_KEY
from autopar_passes.costs import CostModel
from autopar_passes.strategies.types import Strategy
from autopar_passes.trace import TracedModel, trace
from autopar_plans.mesh import MeshSpec

WHOLE = Strategy((), (), 1)  # one device: every op does all of its work


def predicted_reference_s(preset: DevicePreset, traced: TracedModel | None = None) -> float:
    """The cost model's forward and backward seconds of the reference step on ``preset``
    (``traced``: the reference step traced already)."""
    if traced is None:
        traced = traced_reference()
    cost = CostModel(MeshCost(MeshSpec((1,), ("x",)), preset))
    total = 0.0
    for node in traced.graph.nodes:
        note = node.meta.get(META_KEY)
        if node.op == "call_function" and note is not None and note.kind in ("op", "view"):
            total += sum(cost.op_time(note, WHOLE))
    return total


def traced_reference() -> TracedModel:
    model, x = reference_step(torch.device("meta"))
    return trace(model, (x.requires_grad_(),))


def fit_in_step(preset: DevicePreset, measured_s: float) -> float:
    """The ``in_step`` at which the cost model predicts the reference step in ``measured_s``."""
    traced = traced_reference()
    once = predicted_reference_s(preset.model_copy(update={"in_step": 1.0}), traced)
    twice = predicted_reference_s(preset.model_copy(update={"in_step": 2.0}), traced)
    roofline, host = twice - once, 2 * once - twice
    return max(measured_s - host, 0.0) / roofline if roofline > 0 else 1.0
