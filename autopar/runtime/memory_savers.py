"""The runtime's two ways of keeping less for backward, installed on a rank's programs.

- Recompute: the plan's recompute regions (``Plan.recompute``, chosen by the ILP) are
  outlined into non-reentrant activation checkpoints (``autopar_passes.lower_recompute``).
- FSDP regather: a parameter stored sharded is all-gathered before use; the gathered weight
  is not kept for backward but gathered again there (``runtime.regather``).
- Parameter offload: the offloaded parameters are fetched from host memory per layer, and
  a fetched weight is not kept for backward but fetched again there
  (``runtime.param_offload``).

Before the regather is set up, each program's all-gathers of parameters are grouped per
layer into one collective each (``runtime.param_groups``), as FSDP2 gathers a block.

Both act on the programs themselves (the ``GraphModule`` of each pipeline stage, or the one
program), so a forward call and a pipeline schedule's stage calls get them alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from autopar.runtime.collectives import AllGather
from autopar.runtime.param_groups import GatherParams, group_param_gathers
from autopar.runtime.param_offload import FetchParams, HostPiece, Uplink, fetch_params
from autopar.runtime.precision import check_precision
from autopar.runtime.regather import ParamGathers
from autopar_passes.lower_recompute import wrap_recompute
from autopar_plans.plan import Plan


@dataclass(frozen=True)
class Fetched:
    """Parameter offload (``runtime.param_offload``): each offloaded parameter's host copy
    by the ``get_attr`` target the programs read, and where fetches copy them."""

    pieces: Mapping[str, HostPiece]
    uplink: Uplink


def install(
    plan: Plan,
    programs: list[torch.fx.GraphModule],
    is_local: Callable[[torch.Tensor], bool],
    param_layers: Mapping[str, int | None],
    cast: frozenset[str] = frozenset(),
    gathers: ParamGathers | None = None,
    fetched: Fetched | None = None,
) -> ParamGathers | None:
    """Wrap ``plan``'s recompute regions in every program, group the all-gathers of
    parameters per layer (``param_layers``: each parameter's ``get_attr`` target and its
    layer, None outside the layers), and regather parameters that the programs all-gather
    (``is_local``: whether a tensor is a parameter's local tensor as the programs read it,
    a DTensor parameter's shard or a ZeRO working copy); ``cast``: the parameters gathered
    in the compute dtype (``autopar_passes.mixed_precision``); ``gathers``: the record the
    rank's other programs keep, which the collectives they share write to. Returns the
    regather record (None when no program gathers a parameter)."""
    fetches: list[FetchParams] = []
    for program in programs:
        wrap_recompute(program, plan.recompute)
        # after the regions, which leave parameters' gathers outside (grouped here, their
        # outputs the checkpoint's inputs); a region's other reshards run again in backward
        group_param_gathers(program, param_layers, cast, check_precision(plan.precision).compute)
        if fetched is not None:  # after the groups: a group gathers what a fetch made
            mine = fetch_params(program, fetched.pieces, param_layers, fetched.uplink)
            program.register_forward_pre_hook(partial(_drop_prefetches, mine))
            fetches += mine
    gathers_params = [
        module
        for program in programs
        for module in program.modules()
        if isinstance(module, AllGather | GatherParams)
    ]
    if not fetches and (not gathers_params or not _any_sharded_param(plan)):
        return None
    gathers = gathers or ParamGathers(is_local)
    for module in [*gathers_params, *fetches]:
        module.gathers = gathers
    for program in programs:
        _hook_forward(program, gathers)
    return gathers


def _drop_prefetches(fetches: list[FetchParams], *_: Any) -> None:
    """A forward starts with no prefetch in flight (one a stopped forward left is stale)."""
    for fetch in fetches:
        fetch.drop_prefetch()


def _any_sharded_param(plan: Plan) -> bool:
    """Whether some parameter is stored sharded (FSDP / ZeRO-3 or tensor parallel): only
    then can an all-gather take a parameter."""
    return any(not entry.param.is_replicated for entry in plan.params.values())


def _hook_forward(program: nn.Module, gathers: ParamGathers) -> None:
    """Pack gathered parameters as recipes while ``program`` runs forward."""
    active: list[Any] = []

    def enter(_module: nn.Module, _args: Any) -> None:
        gathers.clear()  # recipes are looked up only while packing, in this forward
        context = gathers.hooks()
        context.__enter__()
        active.append(context)

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        if active:
            active.pop().__exit__(None, None, None)

    program.register_forward_pre_hook(enter)
    program.register_forward_hook(leave, always_call=True)
