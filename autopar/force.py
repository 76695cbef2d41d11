"""Named parallel styles as constraints on the solver (for tests, demos and comparisons).

Forcing a style goes through the solver's one constraint mechanism (``autopar_passes.solve``): each
style is a predicate on (node, strategy); the ILP then completes the plan around it. The
styles name the mesh axes they use: ``dp`` for the data-parallel axes and ``tp`` for the
tensor-parallel one (by default the last axis is ``tp`` and the others ``dp``).

- ``dp``: every parameter replicated; every matmul takes its activation batch-sharded over
  every axis (plain data parallelism), and the other operand replicated (a weight) or
  batch-sharded too (a batched matmul of two activations, as in attention). In an einsum
  the batch is the letter its activations and output share and no weight has
  (``batch_dims``: GShard's group, in a mixture of experts).
  A convolution likewise takes its image batch-sharded over every axis and its weight
  replicated (``dp`` and ``fsdp``; the other styles leave convolutions to the solver).
- ``fsdp``: every parameter that can be sharded is stored sharded on the data axes (ZeRO-3)
  and matmuls take the batch sharded on them.
- ``tp``: matmul weights stored and used split on the tp axis (Megatron's column and row
  splits; which one is up to the solver), replicated on the data axes; the batch sharded
  on the data axes and never on the tp axis (a matmul's activation there is whole, or
  split on the features a row-parallel weight contracts); the residual stream (adds of two
  [batch, sequence, hidden] tensors) replicated on tp.
  Expert weights are split inside each expert, never on the expert dim (that is ``ep``).
- ``tp+sp``: as ``tp``, but the residual stream (3-d adds) sharded on the sequence dim over
  the tp axis (Megatron's sequence parallelism).
- ``ep``: expert parallelism on the last axis (GShard, Switch): every expert matmul
  (``autopar_passes.experts``) takes its expert weight split on the expert dim over that axis and
  replicated on the others (experts data-parallel there), its tokens sharded on the others;
  every other matmul is data-parallel over all axes (activation sharded on dim 0, weights
  replicated), so tokens go to their experts and back by all-to-all on the ep axis.
- ``ep+tp``: experts split over the second-to-last axis and tensor-parallel inside (the
  expert weight also split on a non-expert dim) over the last; the other matmuls
  Megatron-style on the last axis and data-parallel on the others; the residual stream
  replicated on the last axis.
"""

from __future__ import annotations

from autopar_passes.experts import expert_matmul
from autopar_passes.plan_build import ADDED_FIRST, MATMULS, is_residual_add
from autopar_passes.solve import Constraint
from autopar_passes.strategies import conv
from autopar_passes.strategies.graph import NodeChoices
from autopar_passes.strategies.types import Strategy
from autopar_plans.errors import UsageError
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import Layout, Replicate, Shard

STYLES = ("dp", "fsdp", "tp", "tp+sp", "ep", "ep+tp")
CONVOLUTIONS = frozenset(str(op) for op in conv.RULES)


def style_constraints(style: str, mesh: MeshSpec, tp_axis: int | None = None) -> list[Constraint]:
    """The constraints that force ``style`` on ``mesh``."""
    if style not in STYLES:
        raise UsageError(f"unknown parallel style {style!r}; one of {', '.join(STYLES)}")
    if style.startswith("ep"):
        return [_expert_rule(style, mesh)]
    axes = list(range(mesh.ndim))
    tp = (mesh.ndim - 1 if tp_axis is None else tp_axis) if style.startswith("tp") else None
    dp_axes = [a for a in axes if a != tp]
    batches: dict[str, list[int | None]] = {}  # node -> its batch dims (asked per strategy)

    def batch_sharded(strategy: Strategy, operand: int, batch: list[int | None]) -> bool:
        layout, dim = strategy.inputs[operand], batch[operand]
        return dim is not None and all(
            isinstance(layout[a], Shard) and layout[a].dim == dim for a in dp_axes
        )

    def rule(node: str, choices: NodeChoices, strategy: Strategy) -> bool:
        note = choices.note
        if choices.kind == "param":
            layout = strategy.outputs[0]
            if style == "dp":
                return layout.is_replicated
            if style == "fsdp":
                sharded = all(isinstance(layout[a], Shard) for a in dp_axes)
                return sharded or not _can_shard(choices, mesh, dp_axes)
            assert tp is not None
            on_dp = all(isinstance(layout[a], Replicate) for a in dp_axes)
            if note is not None and len(note.outputs[0].shape) >= 2 and mesh.shape[tp] > 1:
                return on_dp and isinstance(layout[tp], Shard)
            return on_dp
        if note is None or choices.kind != "op":
            return True
        if note.op in CONVOLUTIONS and style in ("dp", "fsdp") and strategy.inputs:
            image, *rest = strategy.inputs
            return all(image[a] == Shard(0) for a in axes) and all(
                layout.is_replicated for layout in rest
            )
        if note.op in MATMULS and strategy.inputs:
            act = 1 if note.op in ADDED_FIRST else 0  # addmm: (bias, activation, weight)
            if node not in batches:
                batches[node] = batch_dims(choices)
            batch = batches[node]
            if not batch_sharded(strategy, act, batch):
                return False
            if style in ("dp", "fsdp"):
                # a weight replicated; the other operand of a batched matmul of two
                # activations (attention's q k^T, probs v) batch-sharded like the first,
                # which only a batch dim of the contraction can be
                weight_ok = all(
                    isinstance(strategy.inputs[i][a], Replicate)
                    or batch_sharded(strategy, i, batch)
                    for i in range(len(strategy.inputs))
                    if i != act
                    for a in dp_axes
                )
                return weight_ok and all(isinstance(strategy.inputs[act][a], Shard) for a in axes)
            if tp is not None and not _megatron_on(strategy, choices, act, tp, mesh):
                return False  # the tp axis splits weights as used (Megatron), not the batch
            experts = expert_matmul(choices)
            if tp is not None and experts is not None:
                # tensor parallelism inside every expert; splitting the experts is ``ep``
                split = strategy.inputs[experts.weight][tp]
                return isinstance(split, Shard) and split.dim != experts.weight_dim
            return True
        if tp is not None and is_residual_add(choices):
            out = strategy.outputs[0][tp]
            if style == "tp+sp":
                return isinstance(out, Shard) and out.dim == 1
            return isinstance(out, Replicate)
        return True

    return [rule]


def _megatron_on(
    strategy: Strategy, choices: NodeChoices, act: int, axis: int, mesh: MeshSpec
) -> bool:
    """Whether a matmul with a weight runs Megatron's way on ``axis``: the weight used
    split there (not gathered first) and the activation whole or split only on the features
    a row-parallel weight contracts (not over tokens, as data parallelism and FSDP run it).
    A matmul without a weight, or an axis of one device, is free."""
    weights = [i for i, p in enumerate(choices.params) if p is not None]
    if choices.call is None or not weights or mesh.shape[axis] == 1:
        return True
    weight = weights[0]
    if len(choices.call.inputs[weight].shape) >= 2 and not isinstance(
        strategy.inputs[weight][axis], Shard
    ):
        return False
    placement = strategy.inputs[act][axis]
    rank = len(choices.call.inputs[act].shape)
    return not isinstance(placement, Shard) or placement.dim == rank - 1


def batch_dims(choices: NodeChoices) -> list[int | None]:
    """Per tensor input of a matmul, the dim that carries the batch (None: it has none).

    Dim 0, except in an einsum, whose operands order their letters as they please: there
    the batch is the first letter of the first operand that every activation operand and
    the output have and no parameter has. In a GShard layer that is the group ``g``, dim 1
    of the experts' tokens in ``egcd,edf->egcf`` (``e`` is in the weight) and of their
    outputs in ``gsec,egcd->gsd``.
    """
    call = choices.call
    count = len(choices.params)
    if call is None or str(call.target) != "aten.einsum.default":
        return [0] * count
    equation = str(call.args[0]).replace(" ", "")
    if "->" not in equation or "..." in equation:
        return [0] * count
    left, output = equation.split("->")
    operands = left.split(",")
    if len(operands) != count:
        return [0] * count
    activations = [op for op, param in zip(operands, choices.params, strict=True) if param is None]
    weights = "".join(op for op, param in zip(operands, choices.params, strict=True) if param)
    letter = next(
        (
            x
            for x in (activations or operands)[0]
            if x in output and x not in weights and all(x in op for op in activations)
        ),
        None,
    )
    return [None if letter is None or letter not in op else op.index(letter) for op in operands]


def _can_shard(choices: NodeChoices, mesh: MeshSpec, dp_axes: list[int]) -> bool:
    return any(all(isinstance(s.outputs[0][a], Shard) for a in dp_axes) for s in choices.strategies)


def _expert_rule(style: str, mesh: MeshSpec) -> Constraint:
    """The ``ep`` and ``ep+tp`` styles (module docstring), as one predicate."""
    tp = mesh.ndim - 1 if style == "ep+tp" else None
    ep = mesh.ndim - 1 if tp is None else mesh.ndim - 2
    if ep < 0:
        raise UsageError(f"style {style!r} needs a mesh of {mesh.ndim + 1} axes or more")
    axes = range(mesh.ndim)
    dp_axes = [a for a in axes if a not in (ep, tp)]
    token_axes = [a for a in axes if a != tp]  # every axis but tp carries the batch

    def replicated(layout: Layout, on: list[int]) -> bool:
        return all(isinstance(layout[a], Replicate) for a in on)

    def rule(node: str, choices: NodeChoices, strategy: Strategy) -> bool:
        note = choices.note
        if choices.kind != "op" or note is None:
            return True
        if tp is not None and is_residual_add(choices):
            return isinstance(strategy.outputs[0][tp], Replicate)
        if note.op not in MATMULS or not strategy.inputs:
            return True
        found = expert_matmul(choices)
        if found is not None:
            weight, tokens = strategy.inputs[found.weight], strategy.inputs[found.tokens]
            inside = tp is None or (
                isinstance(weight[tp], Shard) and weight[tp].dim != found.weight_dim
            )
            return (
                weight[ep] == Shard(found.weight_dim)
                and replicated(weight, dp_axes)
                and inside
                and all(isinstance(tokens[a], Shard) for a in dp_axes)
            )
        act = 1 if note.op in ADDED_FIRST else 0
        if not all(strategy.inputs[act][a] == Shard(0) for a in token_axes):
            return False
        for i, param in enumerate(choices.params):
            if param is None:
                continue
            if not replicated(strategy.inputs[i], token_axes):
                return False
            if tp is not None and not isinstance(strategy.inputs[i][tp], Shard):
                return False
        return True

    return rule
