"""Parameters as DTensors, programs on plain tensors: the local shards the programs read.

A compiled model's parameters, at the user's paths, are DTensors on the plan's mesh in the
plan's placements (``shards.to_dtensor``), so PyTorch's tools that understand sharding
(``torch.nn.utils.clip_grad_norm_``, ``torch.distributed.checkpoint.state_dict``, the
optimizers' foreach kernels) see the whole model, as they do under FSDP2 and DTensor
tensor parallelism. The lowered programs compute on this rank's plain shards instead,
where their ``get_attr`` reads them (``autopar_passes.rewrites``: ``read_local_tensors``,
``local_view_path``).

As FSDP2 does with its unsharded parameters, each DTensor parameter has one plain leaf
tensor, alive as long as the module, sharing the parameter's local storage (so the
optimizer's in-place steps on the DTensor are what the programs read; ``refresh``, before
each forward, follows the parameter to new storage after ``param.data = ...`` or a load,
and follows its ``requires_grad``). Backward accumulates into the leaves' plain ``.grad``:
autograd's accumulation and the gradient sync's hooks work on plain tensors, with no
DTensor dispatch per parameter per step. A leaf's gradient is what this rank's backwards
added since the last sync; the sync sums it over the replicating axes and ``deliver``
adds the sum into the DTensor parameter's ``.grad`` (or makes it that gradient), freeing
the leaf's, as FSDP2 accumulates reduced gradients into its sharded parameters' and ZeRO
here into its masters'. So a gradient already summed is never summed again: two
backwards without ``zero_grad`` add up, as on one device.

ZeRO-1/2 parameters are not here: the programs read their working copies, and the DTensor
the optimizer steps is the master piece (``runtime.zero``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autopar.runtime.shards import as_dtensor_like, local_of
from autopar_passes.rewrites import local_view_path

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
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its leaf)
        self._leaf_of: dict[int, torch.Tensor] = {}
        self._param_of: dict[int, torch.Tensor] = {}
        for target, param in params.items():
            path = local_view_path(target)
            assert path.startswith(prefix), path
            if id(param) not in self._leaf_of:  # a tied weight: one leaf for its targets
                leaf = local_of(param).detach().requires_grad_(param.requires_grad)
                self._leaf_of[id(param)], self._param_of[id(leaf)] = leaf, param
                self._pairs.append((param, leaf))
            self.__dict__[path[len(prefix) :]] = self._leaf_of[id(param)]
        self._local = frozenset(id(leaf) for leaf in self._leaf_of.values()) | frozenset(
            id(t) for t in working
        )

    def leaf_of(self, param: torch.Tensor) -> torch.Tensor:
        """The plain tensor the programs read for DTensor parameter ``param`` (and whose
        ``.grad`` backward accumulates)."""
        return self._leaf_of[id(param)]

    def param_of(self, leaf: torch.Tensor) -> torch.Tensor:
        """The DTensor parameter whose local shard ``leaf`` is."""
        return self._param_of[id(leaf)]

    def refresh(self, *_hook_args: Any) -> None:
        """Make each leaf its parameter's local shard again (a forward pre-hook)."""
        for param, leaf in self._pairs:
            local = local_of(param)
            if leaf.data_ptr() != local.data_ptr() or leaf.shape != local.shape:
                leaf.data = local
            if leaf.requires_grad != param.requires_grad:
                leaf.requires_grad_(param.requires_grad)

    def deliver(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad``, the summed local gradient of ``leaf``, into its parameter's."""
        param = self._param_of[id(leaf)]
        leaf.grad = None
        if param.grad is None:
            param.grad = as_dtensor_like(param, grad)
        else:
            local_of(param.grad).add_(grad)

    def is_local(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a parameter's local tensor as the programs read it (what
        FSDP's regather may gather again in backward)."""
        return id(tensor) in self._local

    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        return None
