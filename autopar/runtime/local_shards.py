"""Parameters as DTensors, programs on plain tensors: the local shards the programs read.

A compiled model's parameters, at the user's paths, are DTensors on the plan's mesh in the
plan's placements (``shards.to_dtensor``), so PyTorch's tools that understand sharding
(``torch.nn.utils.clip_grad_norm_``, ``torch.distributed.checkpoint.state_dict``, the
optimizers' foreach kernels) see the whole model, as they do under FSDP2 and DTensor
tensor parallelism. The lowered programs compute on this rank's plain shards instead: as
FSDP2 swaps its unsharded parameters in before each forward, ``LocalShards.refresh`` hangs
every parameter's ``to_local()`` where the programs' ``get_attr`` reads it
(``passes.rewrites``: ``read_local_tensors``, ``local_view_path``). ``to_local`` is
differentiable, so backward hands each DTensor parameter a gradient in its own placements.

ZeRO-1/2 parameters are not here: the programs read their working copies, and the DTensor
the optimizer steps is the master piece (``runtime.zero``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from passes.rewrites import local_view_path

HOLDER = "_local_shards"


class LocalShards(nn.Module):
    """The holder, at ``HOLDER`` in the rank's module tree, of the local shards its programs
    read; it saves and loads nothing."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], working: Sequence[torch.Tensor] = ()
    ) -> None:
        """``params``: each DTensor parameter by its ``get_attr`` target; ``working``: the
        ZeRO working copies (local tensors the programs read too)."""
        super().__init__()
        prefix = HOLDER + "."
        self._slots: list[tuple[str, torch.Tensor]] = []
        for target, param in params.items():
            path = local_view_path(target)
            assert path.startswith(prefix), path
            self._slots.append((path[len(prefix) :], param))
        self._working = frozenset(id(t) for t in working)
        self._current: frozenset[int] = frozenset()
        with torch.no_grad():
            self.refresh()

    def refresh(self, *_hook_args: Any) -> None:
        """Hang every parameter's local shard where the programs read it (a forward
        pre-hook: under autograd, a view whose backward reaches the DTensor)."""
        made = []
        for leaf, param in self._slots:
            view = param.to_local()  # type: ignore[attr-defined]
            self.__dict__[leaf] = view
            made.append(id(view))
        self._current = frozenset(made)

    def is_local(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a parameter's local tensor as the programs read it in this
        forward (what FSDP's regather may gather again in backward)."""
        return id(tensor) in self._current or id(tensor) in self._working

    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None
