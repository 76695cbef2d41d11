"""Brute-force check of sharding rules, as DTensor's ``strategy_validation`` does.

For an op and real global inputs: run the op once on the full tensors; then, for every
strategy the rule offers and every device of the mesh (simulated in one process), cut the
inputs into that device's pieces, run the device's local call (``localize``, the same code
the lowering uses), put the outputs back together by their layouts, and compare.

Partial inputs are split into random summands that add up to the tensor, so a rule that
wrongly treats a partial value as replicated fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopar_passes.annotation import TensorInfo, dtype_name
from autopar_passes.strategies.localize import localize
from autopar_passes.strategies.types import OpCall, Rule, Strategy
from autopar_plans.placement import Layout, Partial, Replicate, Shard


@dataclass(frozen=True, slots=True)
class Failure:
    strategy: str
    coords: tuple[int, ...] | None
    problem: str


def op_call(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpCall:
    """The ``OpCall`` a rule would see for this call on these real tensors."""
    out = target(*_cloned(args), **_cloned(kwargs))  # an in-place op writes into a copy
    return OpCall(
        target=target,
        args=_to_info(args),
        kwargs=_to_info(kwargs),
        inputs=tuple(_info(t) for t in _tensors(args) + _tensors(kwargs)),
        outputs=tuple(_info(t) for t in _tensors(out)),
    )


def _cloned(value: Any) -> Any:
    """``value`` with every tensor copied, so that an in-place op leaves the inputs as
    they were for the devices' calls."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list | tuple):
        return type(value)(_cloned(v) for v in value)
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    return value


def check_rule(
    rule: Rule,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    mesh_shape: tuple[int, ...] = (2,),
    *,
    seed: int = 0,
    atol: float = 1e-10,
    rtol: float = 1e-7,
) -> tuple[list[Strategy], list[Failure]]:
    """Run every strategy of ``rule`` for ``target(*args, **kwargs)`` on a simulated mesh.

    Returns the strategies checked and the failures (empty when the rule is right).
    Use float64 inputs where the op allows it, so that only real mistakes exceed ``rtol``.
    """
    kwargs = dict(kwargs or {})
    call = op_call(target, args, kwargs)
    expected = _tensors(target(*_cloned(args), **_cloned(kwargs)))
    strategies = rule(call, mesh_shape)
    failures: list[Failure] = []
    for strategy in strategies:
        failures.extend(
            _check_strategy(call, strategy, args, kwargs, expected, mesh_shape, seed, atol, rtol)
        )
    return strategies, failures


def _check_strategy(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    expected: list[torch.Tensor],
    mesh_shape: tuple[int, ...],
    seed: int,
    atol: float,
    rtol: float,
) -> list[Failure]:
    inputs = _tensors(args) + _tensors(kwargs)
    generator = torch.Generator().manual_seed(seed)
    summands = [
        _summands(t, layout, mesh_shape, generator)
        for t, layout in zip(inputs, strategy.inputs, strict=True)
    ]
    outputs: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for coords in itertools.product(*(range(n) for n in mesh_shape)):
        local_inputs = [
            _local_piece(s, layout, coords, mesh_shape)
            for s, layout in zip(summands, strategy.inputs, strict=True)
        ]
        local_args, local_kwargs = _replace_tensors((args, kwargs), iter(local_inputs))
        try:
            fn, a, k = localize(call, strategy, local_args, local_kwargs, coords, mesh_shape)
            outputs[coords] = _tensors(fn(*a, **k))
        except Exception as error:
            return [Failure(strategy.name, coords, f"{type(error).__name__}: {error}")]
    failures = []
    for index, (want, layout) in enumerate(zip(expected, strategy.outputs, strict=True)):
        try:
            got = _assemble(outputs, index, layout, mesh_shape, (), atol, rtol)
        except AssertionError as error:
            failures.append(Failure(strategy.name, None, f"output {index}: {error}"))
            continue
        if got.shape != want.shape or not torch.allclose(
            got, want, atol=atol, rtol=rtol, equal_nan=True
        ):
            failures.append(
                Failure(
                    strategy.name,
                    None,
                    f"output {index} differs from the "
                    f"unsharded op (shape {tuple(got.shape)} vs {tuple(want.shape)})",
                )
            )
    return failures


def _summands(
    tensor: torch.Tensor, layout: Layout, mesh_shape: tuple[int, ...], generator: torch.Generator
) -> dict[tuple[int, ...], torch.Tensor]:
    """For each combination of coordinates on the partial axes, that device's summand."""
    partial_axes = [a for a, p in enumerate(layout) if isinstance(p, Partial)]
    if not partial_axes or not tensor.is_floating_point():
        return {(): tensor}
    combos = list(itertools.product(*(range(mesh_shape[a]) for a in partial_axes)))
    weights = torch.rand(len(combos), generator=generator, dtype=torch.float64) + 0.5
    weights = weights / weights.sum()
    pieces = {combo: tensor * weights[i].to(tensor.dtype) for i, combo in enumerate(combos)}
    # make the pieces sum exactly to the tensor, whatever the rounding
    last = combos[-1]
    pieces[last] = tensor - sum((pieces[c] for c in combos[:-1]), torch.zeros_like(tensor))
    return pieces


def _local_piece(
    summands: dict[tuple[int, ...], torch.Tensor],
    layout: Layout,
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> torch.Tensor:
    partial_axes = [a for a, p in enumerate(layout) if isinstance(p, Partial)]
    key = tuple(coords[a] for a in partial_axes) if len(summands) > 1 else ()
    piece = summands[key]
    for axis, placement in enumerate(layout):
        if isinstance(placement, Shard):
            piece = piece.chunk(mesh_shape[axis], dim=placement.dim)[coords[axis]]
    return piece.clone(memory_format=torch.contiguous_format)  # its own: ops may write to it


def _assemble(
    outputs: dict[tuple[int, ...], list[torch.Tensor]],
    index: int,
    layout: Layout,
    mesh_shape: tuple[int, ...],
    prefix: tuple[int, ...],
    atol: float,
    rtol: float,
) -> torch.Tensor:
    axis = len(prefix)
    if axis == len(mesh_shape):
        return outputs[prefix][index]
    parts = [
        _assemble(outputs, index, layout, mesh_shape, (*prefix, c), atol, rtol)
        for c in range(mesh_shape[axis])
    ]
    placement = layout[axis]
    if isinstance(placement, Shard):
        return torch.cat(parts, dim=placement.dim)
    if isinstance(placement, Partial):
        return torch.stack(parts).sum(dim=0)
    assert isinstance(placement, Replicate)
    for part in parts[1:]:
        assert part.shape == parts[0].shape and torch.allclose(
            part, parts[0], atol=atol, rtol=rtol, equal_nan=True
        ), f"replicated on mesh axis {axis}, but the devices disagree"
    return parts[0]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _info(tensor: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(tensor.shape), dtype_name(tensor.dtype))


def _to_info(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _info(value)
    if isinstance(value, list | tuple):
        return type(value)(_to_info(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_info(v) for k, v in value.items()}
    return value


def _replace_tensors(value: Any, local: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return next(local)
    if isinstance(value, list | tuple):
        return type(value)(_replace_tensors(v, local) for v in value)
    if isinstance(value, dict):
        return {k: _replace_tensors(v, local) for k, v in value.items()}
    return value


def describe_failures(failures: Sequence[Failure]) -> str:
    return "\n".join(f"{f.strategy} at {f.coords}: {f.problem}" for f in failures)
