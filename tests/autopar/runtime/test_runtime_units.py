"""The runtime's pieces that need no process group: slices, placements, option errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

import autopar
from autopar.runtime.precision import run_precision
from autopar.runtime.shards import local_slices, torch_placements
from autopar_examples.models import build
from autopar_passes.lower_spmd import local_shard
from autopar_plans.errors import UsageError
from autopar_plans.placement import Layout, Partial, Replicate, Shard

LAYOUTS = [
    Layout(Shard(0), Replicate()),
    Layout(Replicate(), Shard(1)),
    Layout(Shard(0), Shard(1)),
    Layout(Shard(1), Shard(0)),
    Layout(Shard(0), Shard(0)),  # one dim split by both axes
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_local_slices_cut_what_the_lowering_holds(layout: Layout) -> None:
    whole = torch.arange(8 * 12).reshape(8, 12)
    for coords in itertools.product(range(2), range(2)):
        piece = whole[local_slices(whole.shape, layout, coords, (2, 2))]
        assert torch.equal(piece, local_shard(whole, layout, coords, (2, 2))), coords


def test_local_slices_refuse_a_dim_the_mesh_does_not_divide() -> None:
    with pytest.raises(UsageError, match="does not divide"):
        local_slices((5, 4), Layout(Shard(0)), (0,), (2,))


def test_placements_in_dtensor_words() -> None:
    assert torch_placements(Layout(Shard(2), Replicate())) == (TorchShard(2), TorchReplicate())
    with pytest.raises(AssertionError):
        torch_placements(Layout(Partial()))


def test_a_precision_the_device_cannot_autocast_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="not supported here"):
        run_precision("bf16_mixed", "meta")
    with pytest.raises(UsageError, match="unknown precision"):
        run_precision("fp8", "cpu")
    assert run_precision("bf16_mixed", "cpu").compute == torch.bfloat16


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"inputs": "sharded"}, "inputs='sharded'"),
        ({"outputs": "local"}, "outputs='local'"),
        ({"precision": "fp8"}, "precision: Input should be 'fp32'"),
        ({"inputs": "local"}, "needs example_inputs"),
    ],
)
def test_compile_options_are_checked_at_the_door(options: dict, message: str) -> None:
    """Before any process group exists: the errors come from compile itself."""
    model, _ = build("mlp-tiny")
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    with pytest.raises(UsageError, match=message):
        autopar.compile(model, mesh, **options)
