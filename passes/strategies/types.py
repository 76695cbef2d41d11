"""What a sharding rule sees (``OpCall``) and what it returns (``Strategy``).

A rule is a pure function ``rule(call, mesh_shape) -> list[Strategy]``: no costs, no
graph. Each strategy says which layout every tensor input must arrive in, which layout each
output leaves in, into how many pieces the op's work is split, and how the lowering runs it
on one device (``Local``). Costs are added by ``autopar_passes.strategies.cost``: compute from the
annotation divided by ``split``, memory from the output layouts, resharding from the edges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar_passes.annotation import TensorInfo
from autopar_plans.placement import Layout, Partial, Replicate, Shard


@dataclass(frozen=True, slots=True)
class OpCall:
    """One op call as a rule sees it.

    ``args``/``kwargs`` are the node's arguments with every tensor replaced by its
    ``TensorInfo``; ``inputs`` lists those tensors in flattened order (args, then kwargs),
    which is the order of ``Strategy.inputs``.
    """

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    name: str = ""

    @property
    def out(self) -> TensorInfo:
        return self.outputs[0]


@dataclass(frozen=True, slots=True)
class Local:
    """How the lowering runs a strategy on one device.

    ``kind`` is ``"same"`` (the same op on local shards, shape arguments made local) or the
    name of a special local op (``"scale"``, ``"vocab_embedding"``, ...) that
    ``autopar_passes.lower_spmd`` emits; ``params`` are its arguments (hashable).
    """

    kind: str = "same"
    params: tuple[Any, ...] = ()


SAME = Local()


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an op on the mesh.

    ``inputs[i]`` is the layout tensor input ``i`` must have; ``outputs[j]`` the layout of
    output ``j``; ``split`` the number of pieces the op's FLOPs and bytes are cut into (1:
    every device does all of it).
    """

    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]
    split: int = 1
    local: Local = SAME
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", describe(self.inputs, self.outputs))


Rule = Callable[[OpCall, tuple[int, ...]], list[Strategy]]

# A special local kind: (call, strategy, local args, local kwargs, coords, mesh shape) ->
# (function, args, kwargs) that the device runs.
LocalKind = Callable[
    [OpCall, Strategy, tuple[Any, ...], dict[str, Any], tuple[int, ...], tuple[int, ...]],
    tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
]


def describe(inputs: Sequence[Layout], outputs: Sequence[Layout]) -> str:
    """``"S(0)R,RS(0)->S(0)P"``: each layout as its placements run together."""

    def one(layout: Layout) -> str:
        return "".join(str(p) for p in layout)

    return ",".join(map(one, inputs)) + "->" + ",".join(map(one, outputs))


def replicate_all(call: OpCall, mesh_shape: tuple[int, ...]) -> Strategy:
    """Every input and output replicated, every device doing all the work: always valid."""
    replicated = Layout.replicated(len(mesh_shape))
    return Strategy(
        inputs=tuple(replicated for _ in call.inputs),
        outputs=tuple(replicated for _ in call.outputs),
    )


def split_of(layouts: Sequence[Layout], mesh_shape: tuple[int, ...]) -> int:
    """The work split implied by layouts: the product of the sizes of axes that shard or
    hold partial values in any of them (an axis that does neither repeats the work)."""
    split = 1
    for axis, size in enumerate(mesh_shape):
        if any(not isinstance(layout[axis], Replicate) for layout in layouts):
            split *= size
    return split


def fits(layout: Layout, info: TensorInfo, mesh_shape: tuple[int, ...]) -> bool:
    """Whether ``layout`` splits ``info`` evenly."""
    return layout.divides(info.shape, mesh_shape)


def all_fit(strategy: Strategy, call: OpCall, mesh_shape: tuple[int, ...]) -> bool:
    pairs = list(zip(strategy.inputs, call.inputs, strict=True)) + list(
        zip(strategy.outputs, call.outputs, strict=True)
    )
    return all(fits(layout, info, mesh_shape) for layout, info in pairs)


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def is_partial(layout: Layout) -> bool:
    return any(isinstance(p, Partial) for p in layout)


def shard(dim: int) -> Shard:
    return Shard(dim)


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)
