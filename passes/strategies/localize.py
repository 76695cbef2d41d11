"""Turn a global op call into the call one device makes under a strategy.

Shape arguments (``view``'s size, ``expand``'s sizes, ``new_zeros``' size) describe the
*global* output; on a device they must describe its *local* piece. Everything else is the
same, except the special ``Local`` kinds, which call a function of ``autopar_passes.local_ops``.
Shared by the lowering and by the brute-force rule check, so what is checked is what runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopar_passes import local_ops
from autopar_passes.strategies.table import local_kinds
from autopar_passes.strategies.types import OpCall, Strategy

aten = torch.ops.aten

# op -> position of the argument that spells the output's shape
SIZE_ARGUMENT: dict[object, int] = {
    aten.view.default: 1,
    aten.reshape.default: 1,
    aten._unsafe_view.default: 1,
    aten.expand.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
}


def local_output_shape(
    call: OpCall, strategy: Strategy, mesh_shape: tuple[int, ...], index: int = 0
) -> tuple[int, ...]:
    return strategy.outputs[index].local_shape(call.outputs[index].shape, mesh_shape)


def localize(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The function and arguments one device at ``coords`` calls for ``call``.

    ``args``/``kwargs`` are the call's arguments with the device's local tensors in place.
    """
    kind = strategy.local.kind
    params = strategy.local.params
    if kind == "same":
        position = SIZE_ARGUMENT.get(call.target)
        if position is not None:
            args = list(args)  # type: ignore[assignment]
            args[position] = list(local_output_shape(call, strategy, mesh_shape))  # type: ignore[index]
            args = tuple(args)
        if call.target == aten.unflatten.int:
            dim = args[1] if args[1] >= 0 else args[1] + len(call.inputs[0].shape)
            out = local_output_shape(call, strategy, mesh_shape)
            args = (args[0], args[1], list(out[dim : dim + len(args[2])]))
        return call.target, args, kwargs
    if kind == "scale":
        (factor,) = params

        def scaled(*a: Any, **k: Any) -> Any:
            return local_ops.scale(call.target(*a, **k), factor)

        return scaled, args, kwargs
    special = local_kinds().get(kind)
    if special is not None:
        return special(call, strategy, args, kwargs, coords, mesh_shape)
    raise ValueError(f"unknown local kind {kind!r} for {call.target}")
