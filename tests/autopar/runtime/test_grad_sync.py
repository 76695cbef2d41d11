"""Gradient buckets as DDP forms them (``runtime.grad_sync``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autopar.runtime.comm import AxisGroup, CommLog
from autopar.runtime.grad_sync import GradientSync
from autopar.testing.ranks import run_ranks

MIB = 2**20


def _params(mib: list[float]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(int(size * MIB) // 4)) for size in mib]


def _sizes(sync: GradientSync) -> list[list[float]]:
    return [[p.numel() * 4 / MIB for p in b.params] for b in sync.buckets]


def test_buckets_fill_in_backward_order_with_a_small_first_one():
    """Gradients arrive last layer first: the first bucket closes at 1 MiB, so its
    all-reduce starts early in backward; the rest close at 25 MiB."""
    group: Any = object()  # only its identity keys the buckets here
    params = _params([10, 10, 10, 0.5, 0.5, 0.5])
    sync = GradientSync([(p, (group,)) for p in params])
    assert _sizes(sync) == [[0.5, 0.5], [0.5, 10, 10, 10]]
    sync.remove()


def test_parameters_replicated_over_other_axes_bucket_apart():
    dp: Any = object()
    dp_tp: Any = object()
    a, b, c = _params([0.25, 0.25, 0.25])
    sync = GradientSync([(a, (dp,)), (b, (dp_tp,)), (c, (dp,)), (_params([1])[0], ())])
    assert [[id(p) for p in bucket.params] for bucket in sync.buckets] == [
        [id(c), id(a)],
        [id(b)],
    ]
    sync.remove()


def test_parameters_of_another_dtype_bucket_apart():
    """A bucket is one flat tensor, and each gradient a view of it: one dtype per bucket."""
    group: Any = object()
    a, b = _params([0.25, 0.25])
    half = nn.Parameter(torch.zeros(16, dtype=torch.bfloat16))
    sync = GradientSync([(a, (group,)), (half, (group,)), (b, (group,))])
    assert [[p.dtype for p in bucket.params] for bucket in sync.buckets] == [
        [torch.float32, torch.float32],
        [torch.bfloat16],
    ]
    sync.remove()


def _sync_step(rank: int, world: int) -> dict[str, Any]:
    """Two fp32 parameters and a bf16 one; rank r's loss is (r + 1) times rank 0's."""
    group = AxisGroup(torch.distributed.group.WORLD, ("dp",), CommLog())
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 3))
    v = nn.Parameter(torch.randn(3))
    h = nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    sync = GradientSync([(p, (group,)) for p in (w, v, h)])
    x = torch.randn(5, 4)
    loss = (rank + 1) * ((x @ w + v) * h.float()).square().sum()
    loss.backward()
    local = torch.autograd.grad(((x @ w + v) * h.float()).square().sum(), [w, v, h])
    sync.remove()
    return {
        "grads": [p.grad.clone() for p in (w, v, h)],
        "local": [g.clone() for g in local],
        "storages": [p.grad.untyped_storage().data_ptr() for p in (w, v, h)],
        "dtypes": [p.grad.dtype for p in (w, v, h)],
    }


def test_backward_leaves_each_gradient_a_view_of_its_summed_bucket():
    """After backward every gradient is the sum over the ranks (here 1 + 2 = 3 times one
    rank's summand), and it is a slice of the bucket that was all-reduced, not a copy:
    the fp32 gradients share one storage, the bf16 one has its own and keeps its dtype."""
    (rank0, rank1) = run_ranks(_sync_step, 2)
    for result in (rank0, rank1):
        for grad, local in zip(result["grads"], result["local"], strict=True):
            torch.testing.assert_close(grad, 3 * local)
        w, v, h = result["storages"]
        assert w == v != h
        assert result["dtypes"] == [torch.float32, torch.float32, torch.bfloat16]
