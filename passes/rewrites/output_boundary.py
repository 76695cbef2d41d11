"""The output boundary without a collective in backward: a whole loss costs one all-reduce.

``autopar_passes.lower_spmd`` makes each output whole and scales its gradient by ``1/copies`` (the
devices holding the same piece), because every device receives the same gradient from the
user's loss, while inside the graph gradients are summands. For a partial output (a loss
summed over the batch shards) the boundary reads::

    all_reduce_dp = self.all_reduce_dp(cross_entropy_loss)
    scale_grad = passes_local_ops_scale_grad(all_reduce_dp, 0.25)

In backward the all-reduce's adjoint then sums ``n`` equal gradients ``g/4``: it gives
``n * g/4`` on every device, which each device can compute alone. So such an all-reduce
skips its adjoint (``AllReduce(adjoint=False)``: the gradient passes through) and its ``n``
moves into the scale (dropped when it becomes 1)::

    all_reduce_dp = self.all_reduce_dp(cross_entropy_loss, adjoint = False)

A data-parallel step with the loss inside the module then runs one scalar all-reduce (the
loss, forward) besides the gradient buckets, instead of two: each is a synchronisation
of every rank (~2 ms on the runtime benchmark's loaded gloo ranks, where a step is ~200 ms).
The gradients are the same (exactly so for a power-of-two ``n`` and ``loss.backward()``).

Where the scale goes and the all-reduce is then the output itself, it is also *deferred*
(``deferred=True``): launched without waiting, its sum waited for when the loss is first
read (``runtime.pending``), so that the ranks do not wait for each other before backward::

    all_reduce_dp = self.all_reduce_dp(cross_entropy_loss, adjoint = False, deferred = True)

Only an all-reduce whose one consumer is the boundary is rewritten: one that also feeds an
op inside the graph receives summands from there, which its adjoint must add up.
"""

from __future__ import annotations

import torch

from autopar_passes.local_ops import scale_grad
from autopar_passes.lower_spmd import LoweredGraph


def skip_output_adjoints(lowered: LoweredGraph, mesh_shape: tuple[int, ...]) -> int:
    """Rewrite, in place, the output all-reduces of ``lowered`` to skip their adjoint;
    return how many were rewritten.

    >>> skip_output_adjoints(lowered, (4,))  # doctest: +SKIP
    1
    """
    output = next(node for node in reversed(lowered.graph.nodes) if node.op == "output")
    rewritten = 0
    for boundary in list(output.all_input_nodes):
        if boundary.target is not scale_grad or len(boundary.users) != 1:
            continue
        reduces = _boundary_all_reduces(boundary.args[0], lowered.collectives)
        if reduces:
            rewritten += _fold_into_scale(boundary, reduces, lowered.collectives, mesh_shape)
    return rewritten


def _boundary_all_reduces(
    node: torch.fx.Node, collectives: dict[str, tuple[str, int]]
) -> list[torch.fx.Node]:
    """The all-reduces feeding the boundary one into the next, each read by nothing else."""
    found = []
    while (
        isinstance(node, torch.fx.Node)
        and node.op == "call_module"
        and collectives.get(str(node.target), ("", 0))[0] == "all_reduce"
        and len(node.users) == 1
        and node.kwargs.get("adjoint", True)
    ):
        found.append(node)
        node = node.args[0]  # type: ignore[assignment]
    return found


def _fold_into_scale(
    boundary: torch.fx.Node,
    reduces: list[torch.fx.Node],
    collectives: dict[str, tuple[str, int]],
    mesh_shape: tuple[int, ...],
) -> int:
    """Mark ``reduces`` adjoint-free and divide the boundary's device count by their axes'
    sizes (integers, so a count of 1 is exact and the scale goes); return how many."""
    value, factor = boundary.args
    copies = round(1.0 / float(factor))  # type: ignore[arg-type]
    done = 0
    for node in reduces:
        size = mesh_shape[collectives[str(node.target)][1]]
        if copies % size:  # not a replicated axis of the output: leave the rest alone
            break
        copies //= size
        node.kwargs = {**node.kwargs, "adjoint": False}
        done += 1
    if copies == 1:
        boundary.replace_all_uses_with(value)  # type: ignore[arg-type]
        boundary.graph.erase_node(boundary)
        if done:  # the outermost all-reduce, adjoint-free, is now the output: defer it
            reduces[0].kwargs = {**reduces[0].kwargs, "deferred": True}
    else:
        boundary.args = (value, 1.0 / copies)
    return done
