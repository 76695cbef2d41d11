"""Data-parallel gradient synchronisation: bucketed, overlapped with backward.

A parameter replicated over some mesh axes has, after the local backward, a *partial*
gradient there: each device holds its summand (its share of the batch, or of the sharded
computation that used the parameter). Summing over those axes gives the true gradient.

As DDP does, parameters are grouped into buckets of about ``bucket_bytes`` in reverse order
of registration (the order backward produces their gradients); when the last gradient of a
bucket is accumulated (``register_post_accumulate_grad_hook``), the bucket's flattened
gradient is all-reduced asynchronously while backward goes on. A callback queued on the
autograd engine waits for every bucket before ``backward`` returns, so the optimizer sees
synchronised gradients. Each gradient then *is* its slice of the summed bucket (a view, as
DDP's ``gradient_as_bucket_view``; for a DTensor parameter, the local shard of its
DTensor gradient): nothing is copied back, one pass over every gradient
per step less than copying (DDP's default). A bucket holds one dtype, so that the views
have their parameters' dtype. As DDP's, the first bucket (the last layers' gradients, ready
first) is small, ``first_bucket_bytes`` (1 MiB, DDP's default), so that communication
starts early in backward instead of after a whole 25 MiB of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.runtime.collectives import unflatten
from autopar.runtime.comm import AxisGroup
from autopar.runtime.shards import local_of, set_local_grad
from plans.buckets import ddp_buckets


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    groups: tuple[AxisGroup, ...]
    ready: int = 0
    handles: list[Any] = field(default_factory=list)
    flat: torch.Tensor | None = None
    wire: torch.Tensor | None = None  # what is summed: ``flat``, or its reduce-dtype copy


class GradientSync:
    """Sums each parameter's gradient over the mesh axes that replicate it."""

    def __init__(
        self,
        params: Sequence[tuple[nn.Parameter, tuple[AxisGroup, ...]]],
        bucket_bytes: int = 25 * 2**20,
        first_bucket_bytes: int = 2**20,
        reduce_dtype: torch.dtype | None = None,
        parts: Sequence[int] | None = None,
    ) -> None:
        """``reduce_dtype``: sum floating-point gradients in this dtype (under mixed
        precision the compute dtype, as FSDP2's ``MixedPrecisionPolicy`` reduces by default
        and DDP's ``bf16_compress_hook`` does), cast back into the buckets after.
        ``parts``: per parameter, the pipeline stage (of this rank's) whose backward makes
        its gradient; a bucket keeps to one, so each is complete in its stage's last
        backward."""
        self.reduce_dtype = reduce_dtype
        listed = list(params)
        part_of = list(parts) if parts is not None else [0] * len(listed)
        synced = [
            (p, groups, part)
            for (p, groups), part in reversed(list(zip(listed, part_of, strict=True)))
            if groups
        ]
        items = [
            ((part, *(id(g) for g in groups), p.dtype, p.device), _local_bytes(p))
            for p, groups, part in synced
        ]
        self.buckets = [
            _Bucket([synced[i][0] for i in bucket], synced[bucket[0]][1])
            for bucket in ddp_buckets(items, bucket_bytes, first_bucket_bytes)
        ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._queued = False
        # off: backward leaves partial gradients alone (gradient accumulation: only the
        # last microbatch's backward syncs, as DDP's ``no_sync``; in a pipeline, each stage's
        # last backward, ``runtime.pipeline``)
        self.enabled = True
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for b in self.buckets
            for p in b.params
        ]

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [
            local_of(p.grad) if p.grad is not None else torch.zeros_like(local_of(p))
            for p in bucket.params
        ]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        dtype = self.reduce_dtype
        cast = dtype is not None and bucket.flat.is_floating_point() and bucket.flat.dtype != dtype
        bucket.wire = bucket.flat.to(dtype) if cast else bucket.flat
        # The first axis overlaps with backward; further axes (rare) follow at the end.
        bucket.handles = [bucket.groups[0].all_reduce(bucket.wire, async_op=True)]

    def _finish(self) -> None:
        for bucket in self.buckets:
            if bucket.ready and bucket.flat is None:
                self._launch(bucket)  # a parameter unused in this step left it incomplete
            for handle in bucket.handles:
                handle.wait()
            if bucket.flat is not None and bucket.wire is not None:
                for group in bucket.groups[1:]:
                    group.all_reduce(bucket.wire)
                if bucket.wire is not bucket.flat:
                    bucket.flat.copy_(bucket.wire)
                sums = unflatten(bucket.flat, [local_of(param).shape for param in bucket.params])
                for param, synced in zip(bucket.params, sums, strict=True):
                    set_local_grad(param, synced)
            bucket.ready, bucket.handles, bucket.flat, bucket.wire = 0, [], None, None
        self._queued = False

    def sync_all(self) -> None:
        """Sum every gradient now, outside backward (after a pipeline schedule, whose
        microbatches' backwards each add to the same gradients)."""
        for bucket in self.buckets:
            bucket.ready = len(bucket.params)
        self._finish()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _local_bytes(param: torch.Tensor) -> int:
    local = local_of(param)
    return local.numel() * local.element_size()
