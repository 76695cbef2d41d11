"""Gradient buckets as DDP forms them (``runtime.grad_sync``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autopar.runtime.grad_sync import GradientSync

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
