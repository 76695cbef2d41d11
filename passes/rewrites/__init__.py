"""The rewrites of one rank's lowered program before it runs, in order (``REWRITES``).

``autopar_passes.lower_spmd`` lowers the traced graph for one rank (a ``LoweredGraph``). Each
rewrite below then edits that rank's graphs in place, in this order, and counts the places
it changed (``CompiledModel.rewrites`` keeps the counts):

1. ``skip_output_adjoints`` (``output_boundary``): an all-reduce that only makes an output
   whole (the loss) skips its adjoint, every rank receiving the same gradient there.
2. ``split_stages`` (pipeline plans; ``autopar_passes.lower_stages``): the graph cut into every
   stage's program; the rank keeps its own stages' graphs, which the rest rewrite.
3. ``fuse_projections`` (``fused_projection``): an exposed projection's einsum and bias
   add run as eager's one matmul with the bias.
4. ``align_linears`` (``aligned_linear``; CUDA only): a 16-bit linear whose output rows are
   not 16-byte aligned runs with its weight padded.
5. ``read_local_tensors``: the graphs compute on plain local tensors, while the
   parameters at the user's paths are DTensors (what PyTorch's tools read). A parameter is
   read from its local shard at ``local_view_path``, which the runtime sets before each
   forward (a differentiable ``to_local()``, so gradients reach the DTensor); a ZeRO-1/2
   parameter (optimizer state sharded beyond it) from its whole working copy at
   ``working_copy_path``, its own path then holding the master piece the optimizer steps
   (``runtime.zero``).

What needs the runtime's own objects is installed after these, on the rank's
``GraphModule``s (``runtime.memory_savers``): the plan's recompute regions as
checkpoints, FSDP's all-gathers grouped per layer and regathered in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from autopar_passes.lower_spmd import LoweredGraph
from autopar_passes.lower_stages import StageProgram, split_stages
from autopar_passes.rewrites.aligned_linear import align_linears
from autopar_passes.rewrites.fused_projection import fuse_projections
from autopar_passes.rewrites.output_boundary import skip_output_adjoints
from autopar_passes.trace import TracedModel
from autopar_plans.plan import Plan


@dataclass
class RankProgram:
    """What the rewrites edit: one rank's lowered program and, once split, its stages."""

    traced: TracedModel
    plan: Plan
    whole: LoweredGraph
    mesh_shape: tuple[int, ...]  # the mesh the plan's layouts are on (a stage's, in a pipeline)
    device_type: str
    stages: tuple[int, ...] = ()  # the pipeline stages (virtual) this rank runs
    programs: list[StageProgram] = field(default_factory=list)  # every stage's, once split
    graphs: list[torch.fx.Graph] = field(default_factory=list)  # what this rank runs

    @property
    def own_programs(self) -> list[StageProgram]:
        """This rank's stages' programs, in its order of ``stages``."""
        return [self.programs[stage] for stage in self.stages]


@dataclass(frozen=True)
class Rewrite:
    name: str
    run: Callable[[RankProgram], int]  # edits in place; returns how many places changed


def working_copy_path(target: str) -> str:
    """Where a ZeRO parameter's working copy hangs in the rank's module tree."""
    return "_zero_working." + target.replace(".", "__")


def local_view_path(target: str) -> str:
    """Where the local shard of the (DTensor) parameter at ``target`` is read from."""
    return "_local_shards." + target.replace(".", "__")


def _skip_output_adjoints(rank: RankProgram) -> int:
    return skip_output_adjoints(rank.whole, rank.mesh_shape)


def _split_stages(rank: RankProgram) -> int:
    if rank.plan.parallelism.pp == 1:
        rank.graphs = [rank.whole.graph]
        return 0
    rank.programs = split_stages(rank.traced, rank.whole, rank.plan)
    rank.graphs = [program.graph for program in rank.own_programs]
    return len(rank.graphs)


def _fuse_projections(rank: RankProgram) -> int:
    return sum(fuse_projections(graph) for graph in rank.graphs)


def _align_linears(rank: RankProgram) -> int:
    if rank.device_type != "cuda":  # CPU kernels gain nothing from the padding
        return 0
    return sum(align_linears(graph) for graph in rank.graphs)


def _read_local_tensors(rank: RankProgram) -> int:
    path = {
        target: working_copy_path(target)
        if rank.plan.holds_master(name, rank.mesh_shape)
        else local_view_path(target)
        for target, name in rank.whole.params.items()
    }
    rewritten = 0
    for graph in rank.graphs:
        for node in graph.nodes:
            if node.op == "get_attr" and node.target in path:
                node.target = path[str(node.target)]
                rewritten += 1
    return rewritten


REWRITES: tuple[Rewrite, ...] = (
    Rewrite("skip_output_adjoints", _skip_output_adjoints),
    Rewrite("split_stages", _split_stages),
    Rewrite("fuse_projections", _fuse_projections),
    Rewrite("align_linears", _align_linears),
    Rewrite("read_local_tensors", _read_local_tensors),
)


def rewrite_rank(rank: RankProgram) -> dict[str, int]:
    """Run ``REWRITES`` on ``rank`` in order; each one's count of places changed."""
    return {rewrite.name: rewrite.run(rank) for rewrite in REWRITES}
