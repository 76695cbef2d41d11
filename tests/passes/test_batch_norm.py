"""Training batch norm written out as sums (``autopar_passes.batch_norm``): over the whole
batch by default, over each device's slice under ``batch_norm="per_device"``."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar_examples.models import build
from autopar_plans.io import dump_plan, load_plan_text


def _resnet(batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return build("resnet-tiny", batch_size=batch)


def _sums(traced: autopar.TracedModel) -> list[tuple[int, ...]]:
    """The shapes of the statistics (the first sum of each written-out batch norm)."""
    return [
        tuple(node.meta["val"].shape)
        for node in traced.graph.nodes
        if node.name.endswith("_sum") and node.target == torch.ops.aten.sum.dim_IntList
    ]


def test_statistics_are_per_channel_or_per_slice_and_channel() -> None:
    model, inputs = _resnet(8)
    whole, sliced = (autopar.trace(model, inputs, batch_norm_groups=g) for g in (1, 4))
    assert _sums(whole) and all(len(shape) == 1 for shape in _sums(whole))
    assert [(4, *shape) for shape in _sums(whole)] == _sums(sliced)


def test_per_device_plan_records_its_slices_and_keeps_them_through_a_file() -> None:
    model, inputs = _resnet(8)
    mesh = autopar.Mesh((4,), device="cpu")
    plan = autopar.plan(model, mesh, inputs, force="dp", batch_norm="per_device")
    assert plan.batch_norm_groups == 4
    assert load_plan_text(dump_plan(plan), "json").batch_norm_groups == 4
    assert autopar.plan(model, mesh, inputs, force="dp").batch_norm_groups == 1


def test_a_batch_the_devices_do_not_divide_is_refused_plainly() -> None:
    model, inputs = _resnet(6)
    with pytest.raises(
        autopar.UsageError, match="batch is 6; pass a batch that is a multiple of 4"
    ):
        autopar.plan(model, autopar.Mesh((4,), device="cpu"), inputs, batch_norm="per_device")
