"""FSDP's memory saving at run time: gathered parameters are not kept for backward.

A parameter stored sharded (ZeRO-3 / FSDP) is all-gathered before use, and the op using it
(a matmul) saves the gathered weight for its backward: left alone, autograd would keep every
layer's whole weight from the forward until the backward, which is the memory FSDP exists
to save. So, as FSDP does, the gathered weight is dropped and gathered again when backward
needs it: the all-gather modules record which tensors they made from a parameter, and a
``saved_tensors_hooks`` pair packs such a tensor (or a view of it) as a recipe (the local
shard and the gathers to replay) and unpacks it by replaying them.

A recipe starts from a ``Source``: a parameter's local shard, or one member of a group of
parameters gathered together (``runtime.param_groups``), whose first unpack in backward
gathers the whole group once for all of the group's saved tensors.

Tensors are recognised by identity (through a weak reference), not by address: a freed
gathered weight's memory may hold another tensor by the time something else is saved.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from autopar.runtime.collectives import all_gather
from autopar.runtime.comm import AxisGroup

Gather = tuple[int, AxisGroup]  # (tensor dim, process group of one mesh axis)


class Source(Protocol):
    """Where a recipe's replay starts: what backward fetches before the recipe's gathers."""

    def claim(self) -> None:
        """A saved tensor was packed with a recipe starting here (it will be fetched)."""

    def fetch(self) -> torch.Tensor:
        """The tensor to replay the gathers on, for one saved tensor being unpacked."""
        ...


@dataclass(frozen=True)
class _Shard:
    """A parameter's local shard: the recipe's gathers rebuild the whole weight from it."""

    tensor: torch.Tensor

    def claim(self) -> None:
        return None

    def fetch(self) -> torch.Tensor:
        return self.tensor.detach()


@dataclass(frozen=True)
class _Recipe:
    source: Source
    gathers: tuple[Gather, ...]

    def replay(self) -> torch.Tensor:
        value = self.source.fetch()
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


class BackwardOrder:
    """The order in which backward reaches one forward's groups of parameters (FSDP
    groups, ``param_groups.GroupRegather``; offloaded ones, ``param_offload.Refetch``): the
    reverse of the order their weights were last packed for backward, FSDP2's post-forward
    order. Backward's first unpack of a group launches the next group of this order (its
    prefetch). A tied embedding that the head reads too is packed last, at the head, so it
    comes first in backward, where the head's backward needs it, not last, where the
    embedding's forward gathered it."""

    def __init__(self) -> None:
        self._packed: dict[Any, None] = {}  # insertion-ordered: the last packed last

    def packed(self, group: Any) -> None:
        """One of ``group``'s weights was packed for backward."""
        self._packed.pop(group, None)
        self._packed[group] = None

    def after(self, group: Any) -> Iterator[Any]:
        """The groups backward reaches after ``group``, the nearest first."""
        order = list(self._packed)
        if group in self._packed:
            yield from reversed(order[: order.index(group)])

    def prefetch_after(self, group: Any) -> None:
        """Launch the fetch of the group backward reaches next after ``group`` among those it
        will still fetch (each has ``pending`` and ``prefetch()``)."""
        for candidate in self.after(group):
            if candidate.pending:
                candidate.prefetch()
                return

    def backward(self) -> list[Any]:
        """The groups in the order backward reaches them."""
        return list(reversed(self._packed))


class ParamGathers:
    """What the all-gathers of one forward made from parameters, and the hooks that drop
    those tensors from autograd's saved state."""

    def __init__(self, is_param: Callable[[torch.Tensor], bool]) -> None:
        self._is_param = is_param
        self._made: dict[int, tuple[weakref.ref[torch.Tensor], _Recipe]] = {}
        # the order backward reaches this forward's groups of parameters
        # (``param_groups``) and of offloaded ones (``param_offload``): for its prefetch
        self.regathers = BackwardOrder()
        self.refetches = BackwardOrder()

    def clear(self) -> None:
        self._made.clear()
        self.regathers = BackwardOrder()
        self.refetches = BackwardOrder()

    def record(
        self, output: torch.Tensor, source: torch.Tensor, dim: int, group: AxisGroup
    ) -> None:
        """``output`` was all-gathered from ``source`` along ``dim`` over ``group``."""
        if self._is_param(source):
            recipe = _Recipe(_Shard(source), ((dim, group),))
        else:
            known = self._lookup(source, whole=True)
            if known is None:
                return  # an activation: nothing to do
            recipe = _Recipe(known.source, (*known.gathers, (dim, group)))
        self._remember(output, recipe)

    def record_sources(self, outputs: Sequence[torch.Tensor], sources: Sequence[Source]) -> None:
        """Each of ``outputs`` is a whole parameter that ``sources`` can give again."""
        for output, source in zip(outputs, sources, strict=True):
            self._remember(output, _Recipe(source, ()))

    def sources_of(self, tensors: Sequence[torch.Tensor]) -> list[Source] | None:
        """Where each of ``tensors`` can be had again, if every one is a whole parameter a
        fetch made (``runtime.param_offload``): a group gathering them need not keep them."""
        recipes = [self._lookup(t, whole=True) for t in tensors]
        if any(r is None or r.gathers for r in recipes):
            return None
        return [r.source for r in recipes if r is not None]

    def _remember(self, output: torch.Tensor, recipe: _Recipe) -> None:
        for made in (output, output._base):  # autograd may hand out a view of it
            if made is not None:
                self._made[id(made)] = (weakref.ref(made), recipe)

    def _lookup(self, tensor: torch.Tensor, whole: bool = False) -> _Recipe | None:
        """The recipe of ``tensor`` or of the tensor it views (``whole``: only of a view
        that is all of it, since what is replayed from it is the whole)."""
        for candidate in (tensor, tensor._base):
            if candidate is None:
                continue
            if whole and not _same_view(tensor, candidate):
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
                recipe.source.claim()
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


def _same_view(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    return (
        tensor.size() == base.size()
        and tensor.stride() == base.stride()
        and tensor.storage_offset() == base.storage_offset()
    )
