"""Training batch norm written out as sums (``autopar_passes.batch_norm``): over the whole
batch by default, over each device's slice under ``batch_norm="per_device"``."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar_examples.models import build
from autopar_plans.io import dump_plan, load_plan_text
from autopar_plans.placement import Layout, Replicate, Shard


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


def _largest_reshard(plan: autopar.Plan) -> float:
    """The most bytes one reshard moves."""
    return max(c.bytes_per_call for c in plan.estimate.comm if c.what.startswith("reshard"))


def test_forced_data_parallel_splits_every_convolutions_batch() -> None:
    model, inputs = _resnet(8)
    plan = autopar.plan(model, autopar.Mesh((2, 2), device="cpu"), inputs, force="dp")
    convolutions = [op for op in plan.ops.values() if op.op == "aten.conv2d.default"]
    assert len(convolutions) == 12  # 2 a basic block, 3 shortcuts, the stem
    assert all(op.output == Layout(Shard(0), Shard(0)) for op in convolutions)
    assert all(op.inputs[1] == Layout(Replicate(), Replicate()) for op in convolutions)


@pytest.mark.slow
def test_resnet50_at_8192_images_on_64_h100s_is_data_parallel() -> None:
    """The seeds' large-batch ResNet-50 (ImageNet shape, 8192 images a step) on 8 nodes of
    8 H100s, left to the solver: every convolution splits the batch over all 64 devices,
    no accumulation is needed to fit, and no convolutional layer's activation crosses
    devices (the classifier may split its 1000 classes, gathering its features). Before
    the batch norms' statistics were cast through an empty scalar, their ``type_as(v, x)``
    wanted every input whole: 154 GB of all-gathers a step, 1.26 s estimated, not 137 ms."""
    model, inputs = build("resnet50", device="meta", batch_size=8192)
    mesh = autopar.Mesh.cluster(nodes=8, gpus_per_node=8, device="h100-sxm")
    plan = autopar.plan(
        model, mesh, inputs, stages=1, precision="bf16_mixed", optimizer="sgd_momentum"
    )
    convolutions = [op for op in plan.ops.values() if op.op == "aten.conv2d.default"]
    assert len(convolutions) == 53
    assert all(op.output == Layout(Shard(0), Shard(0)) for op in convolutions)
    assert plan.microbatch_size == 8192
    # the head's pooled features [8192, 2048] or logits may move; the smallest activation
    # of a convolutional layer, [8192, 2048, 7, 7] in bf16, is 1.6 GB
    assert _largest_reshard(plan) <= 8192 * 2048 * 4
