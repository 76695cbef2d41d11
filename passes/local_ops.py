"""Local steps the lowering emits that need no communication, only the device's coordinates.

The lowered per-rank code calls these as plain functions with the rank's coordinates baked
in as constants, so ``autopar codegen --rank r`` shows exactly what rank ``r`` runs. Each is
differentiable: autograd derives its backward (the adjoint of a slice is a zero-pad, etc.).
"""

from __future__ import annotations

import torch


def shard_slice(x: torch.Tensor, dim: int, index: int, pieces: int) -> torch.Tensor:
    """Replicate -> Shard(dim): keep piece ``index`` of ``pieces`` equal pieces along ``dim``."""
    size = x.shape[dim] // pieces
    return x.narrow(dim, index * size, size)


def zero_unless_first(x: torch.Tensor, index: int) -> torch.Tensor:
    """Replicate -> Partial: the first device on the axis keeps the value, the others zeros.

    A multiplication rather than a branch keeps every device's autograd graph the same
    shape (the others' gradient is zero, not absent), so gradient hooks fire alike.
    """
    return x * (1.0 if index == 0 else 0.0)


def zero_pad(x: torch.Tensor, dim: int, index: int, pieces: int) -> torch.Tensor:
    """Shard(dim) -> Partial: put the shard in its place in a zero tensor of the full size."""
    size = x.shape[dim]
    before, after = index * size, (pieces - 1 - index) * size
    pad = [0, 0] * (x.dim() - 1 - dim) + [before, after]
    return torch.nn.functional.pad(x, pad)


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply by a constant (a mean over a sharded dim becomes a partial sum)."""
    return x * factor


def vocab_parallel_embedding(
    weight: torch.Tensor, indices: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Embedding with the table's rows ``[start, end)`` on this device (Megatron's
    vocabulary-parallel embedding): rows it does not hold give zeros; the sum over the axis
    is the full lookup (a ``Partial`` output)."""
    inside = (indices >= start) & (indices < end)
    local = torch.where(inside, indices - start, torch.zeros_like(indices))
    rows = torch.nn.functional.embedding(local, weight)
    return rows * inside.unsqueeze(-1).to(rows.dtype)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, factor: float
    ) -> torch.Tensor:
        ctx.factor = factor  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None  # type: ignore[attr-defined]


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by ``factor``.

    At the module's outputs: every device receives the same full gradient from the user's
    loss, but inside the module a gradient is held as summands (each device's local backward
    computes its part, and the parts add up across the mesh). Dividing by the number of
    devices turns the one into the other.
    """
    return _ScaleGrad.apply(x, factor)
