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
DDP's ``gradient_as_bucket_view``): nothing is copied back, one pass over every gradient
per step less than copying (DDP's default). A bucket holds one dtype, so that the views
have their parameters' dtype. As DDP's, the first bucket (the last layers' gradients, ready
first) is small, ``first_bucket_bytes`` (1 MiB, DDP's default), so that communication
starts early in backward instead of after a whole 25 MiB of it.

It works on the plain tensors backward accumulates into (a DTensor parameter's leaf,
``runtime.local_shards``), and hands each summed gradient to ``deliver``, which adds it
into the gradient of the parameter the user sees and frees the leaf's: what a backward
adds is summed once, however many backwards a step has. A parameter that no axis
replicates is delivered as it is, at the same moment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.runtime.collectives import unflatten
from autopar.runtime.comm import AxisGroup
from autopar.runtime.compression import Compressor
from autopar.runtime.reduction import BucketSum, steps_for
from autopar_plans.buckets import ddp_buckets
from autopar_plans.reduction import PER_AXIS, GradReduction


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    groups: tuple[AxisGroup, ...]
    ready: int = 0
    flat: torch.Tensor | None = None
    running: BucketSum | None = None  # the sum of ``flat`` (or its reduce-dtype copy)
    # those a compression scheme encodes (summed after backward, ``_finish``); the others
    # are ``plain``, laid end to end in ``flat``
    encoded: list[torch.Tensor] = field(default_factory=list)

    @property
    def plain(self) -> list[torch.Tensor]:
        encoded = {id(p) for p in self.encoded}
        return [p for p in self.params if id(p) not in encoded]


class GradientSync:
    """Sums each parameter's gradient over the mesh axes that replicate it."""

    def __init__(
        self,
        params: Sequence[tuple[torch.Tensor, tuple[AxisGroup, ...]]],
        bucket_bytes: int = 25 * 2**20,
        first_bucket_bytes: int = 2**20,
        reduce_dtype: torch.dtype | None = None,
        parts: Sequence[int] | None = None,
        deliver: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        policy: GradReduction | None = None,
    ) -> None:
        """``reduce_dtype``: sum floating-point gradients in this dtype (under mixed
        precision the compute dtype, as FSDP2's ``MixedPrecisionPolicy`` reduces by default
        and DDP's ``bf16_compress_hook`` does), cast back into the buckets after.
        ``parts``: per parameter, the pipeline stage (of this rank's) whose backward makes
        its gradient; a bucket keeps to one, so each is complete in its stage's last
        backward. ``deliver(tensor, summed)``: where a summed gradient goes (by default, it
        becomes ``tensor.grad``). ``policy``: the form of a sum over several axes
        (``autopar_plans.reduction``)."""
        self.reduce_dtype = reduce_dtype
        self.policy = policy or PER_AXIS
        scheme = self.policy.compression
        self._compressor = (
            Compressor(scheme, seed_offset=dist.get_rank()) if scheme.encodes else None
        )
        # off under local SGD (``runtime.local_sgd``): each gradient is delivered as this
        # device's own, scaled to the mean over its batch (``local_scale``), summing nothing
        self.summing = True
        self._deliver = deliver or _set_grad
        listed = list(params)
        part_of = list(parts) if parts is not None else [0] * len(listed)
        tagged = list(zip(listed, part_of, strict=True))
        synced = [(p, groups, part) for (p, groups), part in reversed(tagged) if groups]
        items = [
            ((part, *(id(g) for g in groups), p.dtype, p.device), _local_bytes(p))
            for p, groups, part in synced
        ]
        self.buckets = [
            _Bucket([synced[i][0] for i in bucket], synced[bucket[0]][1])
            for bucket in ddp_buckets(items, bucket_bytes, first_bucket_bytes)
        ]
        for bucket in self.buckets:
            bucket.encoded = [p for p in bucket.params if scheme.compresses(tuple(p.shape))]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._direct = [p for p, groups in listed if not groups]
        self._queued = False
        # off: backward leaves partial gradients alone (gradient accumulation: only the
        # last microbatch's backward syncs, as DDP's ``no_sync``; in a pipeline, each stage's
        # last backward, ``runtime.pipeline``)
        self.enabled = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p, _ in listed]

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        bucket = self._bucket_of.get(id(param))
        if bucket is None:
            return  # delivered as it is, at the end
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if not self.summing:
            bucket.flat = torch.empty(0)  # delivered as it is, at the end
            return
        plain = bucket.plain
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plain]
        if not grads:
            bucket.flat = torch.empty(0)
            return
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        dtype = self.reduce_dtype
        cast = dtype is not None and bucket.flat.is_floating_point() and bucket.flat.dtype != dtype
        wire = bucket.flat.to(dtype) if cast else bucket.flat
        # the first call overlaps with backward; the rest follow at the end
        bucket.running = BucketSum(wire, steps_for(self.policy, bucket.groups), bucket.groups)

    def _finish(self) -> None:
        for bucket in self.buckets:
            if bucket.ready and bucket.flat is None:
                self._launch(bucket)  # a parameter unused in this step left it incomplete
            if bucket.flat is not None and not self.summing:
                self._deliver_local(bucket.params, group_size(bucket.groups))
            elif bucket.flat is not None:
                self._deliver_sums(bucket)
            bucket.ready, bucket.flat, bucket.running = 0, None, None
        for param in self._direct:
            if param.grad is not None:
                self._deliver(param, param.grad)
        self._queued = False

    def _deliver_sums(self, bucket: _Bucket) -> None:
        """Deliver each summed gradient of ``bucket``: the plain ones from the bucket's sum
        (views of it), the encoded ones from the compressor's."""
        if bucket.running is not None:
            flat = bucket.flat
            assert flat is not None
            summed = bucket.running.wait()
            if summed.data_ptr() != flat.data_ptr() or summed.dtype != flat.dtype:
                flat.copy_(summed)
            plain = bucket.plain
            for param, synced in zip(plain, unflatten(flat, [p.shape for p in plain]), strict=True):
                if param.requires_grad:  # a frozen one's zeros keep the buckets alike
                    self._deliver(param, synced)
        if bucket.encoded and self._compressor is not None:
            grads = [
                (p.grad if p.grad is not None else torch.zeros_like(p)).float()
                for p in bucket.encoded
            ]
            keys = [id(p) for p in bucket.encoded]
            sums = self._compressor.reduce(grads, bucket.groups, keys)
            for param, synced in zip(bucket.encoded, sums, strict=True):
                if param.requires_grad:
                    self._deliver(param, synced.to(param.dtype))

    def _deliver_local(self, params: list[torch.Tensor], devices: int) -> None:
        """Local SGD: each gradient as this device's own mean over its share of the batch
        (its summand of the global mean, times the devices that share the batch)."""
        for param in params:
            if param.grad is not None and param.requires_grad:
                self._deliver(param, param.grad.mul_(devices))

    def compression_state_bytes(self) -> int:
        """Bytes the compression scheme keeps between steps (error feedback, PowerSGD's Q)."""
        return self._compressor.state_bytes() if self._compressor is not None else 0

    def sync_all(self) -> None:
        """Sum every gradient now, outside backward (after a pipeline schedule, whose
        microbatches' backwards each add to the same gradients)."""
        for bucket in self.buckets:
            bucket.ready = len(bucket.params)
        self._finish()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def group_size(groups: Sequence[AxisGroup]) -> int:
    """Devices the groups (one mesh axis each) span together."""
    return math.prod(g.size for g in groups)


def _set_grad(tensor: torch.Tensor, summed: torch.Tensor) -> None:
    tensor.grad = summed


def _local_bytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()
