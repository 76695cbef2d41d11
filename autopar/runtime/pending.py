"""An output whose all-reduce is still in flight: waited for when its value is first read.

A data-parallel step with the loss inside the module returns the global loss, which takes
one scalar all-reduce at the end of forward (``autopar_passes.rewrites.output_boundary``). Done
there and waited for, it makes every rank wait for the slowest before its backward can start: a
synchronisation that DDP, returning each rank's local loss, does not have. On the runtime
benchmark's loaded gloo ranks it cost 2 to 3% of a step.

Nothing in backward needs the loss's value: ``loss.backward()`` only makes a gradient of
ones of its shape. So the output all-reduce is launched without waiting, and the module
returns a ``PendingSum``: a tensor of the same shape and dtype whose value is the sum once
the collective has completed. Any op that reads it (``item()``, ``detach()``, printing,
formatting, ``numpy()``, arithmetic) waits first, so no reader can see a partial value;
only the ``*_like`` factories, which read the shape alone, do not wait. The usual loop
(forward, backward, step, then read the loss) waits once, when the sum is long done.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.runtime.comm import AxisGroup

aten = torch.ops.aten

# ops that read only a tensor's shape, dtype and device (autograd's ``ones_like`` for the
# loss's gradient is the one that matters)
_SHAPE_ONLY = frozenset({aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default})


class PendingSum(torch.Tensor):
    """The sum of ``buffer`` over a group, being computed in place by ``work``."""

    _buffer: torch.Tensor
    _work: Any

    @staticmethod
    def __new__(cls, buffer: torch.Tensor, work: Any) -> PendingSum:
        pending = torch.Tensor._make_wrapper_subclass(
            cls,
            buffer.shape,
            strides=buffer.stride(),
            dtype=buffer.dtype,
            device=buffer.device,
            requires_grad=False,
        )
        pending._buffer, pending._work = buffer, work
        return pending

    def wait(self) -> torch.Tensor:
        """The summed value (a plain tensor), once the collective has completed."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._buffer

    @property
    def in_flight(self) -> bool:
        """Whether nothing has waited for the sum yet."""
        return self._work is not None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(value: Any) -> Any:
            if not isinstance(value, PendingSum):
                return value
            return value._buffer if func in _SHAPE_ONLY else value.wait()

        return func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))

    # reads that do not go through dispatch (Python-level methods of ``Tensor``)
    def __repr__(self) -> str:  # type: ignore[override]
        return repr(self.wait())

    def __format__(self, spec: str) -> str:
        return self.wait().__format__(spec)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wait().__array__(*args, **kwargs)

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.wait().numpy(*args, **kwargs)

    def tolist(self) -> Any:  # type: ignore[override]
        return self.wait().tolist()

    # pickled (``torch.save``, a result sent to another process) and copied as its value
    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.wait().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.wait().clone()


class DeferredAllReduce(torch.autograd.Function):
    """Sum ``x`` over ``group`` without waiting; the gradient passes through (an output
    all-reduce that skips its adjoint, ``autopar_passes.rewrites.output_boundary``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        buffer = x.detach().clone(memory_format=torch.contiguous_format)
        return PendingSum(buffer, group.all_reduce(buffer, async_op=True))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
