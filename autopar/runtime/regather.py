"""FSDP's memory saving at run time: gathered parameters are not kept for backward.

A parameter stored sharded (ZeRO-3 / FSDP) is all-gathered before use, and the op using it
(a matmul) saves the gathered weight for its backward: left alone, autograd would keep every
layer's whole weight from the forward until the backward, which is the memory FSDP exists
to save. So, as FSDP does, the gathered weight is dropped and gathered again when backward
needs it: the all-gather modules record which tensors they made from a parameter, and a
``saved_tensors_hooks`` pair packs such a tensor (or a view of it) as a recipe (the local
shard and the gathers to replay) and unpacks it by replaying them.

Tensors are recognised by identity (through a weak reference), not by address: a freed
gathered weight's memory may hold another tensor by the time something else is saved.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.collectives import all_gather

Gather = tuple[int, dist.ProcessGroup]  # (tensor dim, process group of one mesh axis)


@dataclass(frozen=True)
class _Recipe:
    shard: torch.Tensor  # the parameter's local shard
    gathers: tuple[Gather, ...]

    def replay(self) -> torch.Tensor:
        value = self.shard.detach()
        for dim, group in self.gathers:
            value = all_gather(value, dim, group)
        return value


@dataclass(frozen=True)
class _Outer:
    value: Any  # what the outer hooks' pack made


@dataclass(frozen=True)
class _Packed:
    recipe: _Recipe
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class ParamGathers:
    """What the all-gathers of one forward made from parameters, and the hooks that drop
    those tensors from autograd's saved state."""

    def __init__(self, is_param: Callable[[torch.Tensor], bool]) -> None:
        self._is_param = is_param
        self._made: dict[int, tuple[weakref.ref[torch.Tensor], _Recipe]] = {}

    def clear(self) -> None:
        self._made.clear()

    def record(
        self, output: torch.Tensor, source: torch.Tensor, dim: int, group: dist.ProcessGroup
    ) -> None:
        """``output`` was all-gathered from ``source`` along ``dim`` over ``group``."""
        if self._is_param(source):
            recipe = _Recipe(source, ((dim, group),))
        else:
            known = self._lookup(source)
            if known is None:
                return  # an activation: nothing to do
            recipe = _Recipe(known.shard, (*known.gathers, (dim, group)))
        for made in (output, output._base):  # autograd may hand out a view of it
            if made is not None:
                self._made[id(made)] = (weakref.ref(made), recipe)

    def _lookup(self, tensor: torch.Tensor) -> _Recipe | None:
        for candidate in (tensor, tensor._base):
            if candidate is None:
                continue
            entry = self._made.get(id(candidate))
            if entry is not None and entry[0]() is candidate:
                return entry[1]
        return None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks that pack gathered parameters as recipes and hand every other tensor to
        the hooks active outside (a user's offloading, a memory probe), which a plain
        inner pair would shadow."""
        # private, but what torch itself uses to read the active pair (aot_autograd)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(tensor: torch.Tensor) -> Any:
            recipe = self._lookup(tensor)
            if recipe is not None:
                return _Packed(
                    recipe, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset()
                )
            return _Outer(outer[0](tensor)) if outer is not None else tensor

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _Packed):
                whole = packed.recipe.replay()
                return whole.as_strided(packed.size, packed.stride, packed.offset)
            if isinstance(packed, _Outer):
                assert outer is not None
                return outer[1](packed.value)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
