"""The SPMD lowering: rewrite the traced graph into the code one device runs.

Reads the traced graph and the chosen strategy of every node; writes, for the device at
mesh coordinates ``coords``, a new ``torch.fx.Graph`` in which

- a parameter is its local shard (``get_attr`` of the parameter's own name, which the
  runtime fills with the shard), a buffer or constant is replicated (``get_attr``), a user
  input is a ``placeholder`` in the layout ``layout_of`` gives it (whole by default; a
  slice with ``PlanLayouts(local_inputs=True)``);
- every op runs on local tensors (``autopar_passes.strategies.localize``: local shape arguments, or
  a special local op of ``autopar_passes.local_ops``);
- on every edge where the producer's layout is not the layout the consumer needs, the
  reshard is emitted (``emit_reshard``: the steps of ``autopar_plans.reshard.plan_reshard``, which
  the cost model priced): free local steps (slice, zero, pad) as calls into
  ``autopar_passes.local_ops`` with this device's coordinates baked in, collectives as calls to
  submodules named ``<collective>_<axis>`` (``all_gather_tp``) that the runtime provides;
  one reshard per (tensor, layout) is shared by all consumers;
- each output is brought back whole on every device, or with ``sharded_outputs`` left in
  its layout (only ``Partial`` placements summed, so no partial sums leak out), and its
  gradient scaled to the summand convention (``local_ops.scale_grad``, below).

Every collective's backward is its adjoint (all-gather <-> reduce-scatter, all-reduce <->
all-reduce, all-to-all <-> all-to-all), so the local backward of this graph computes each
device's summand of every gradient; parameter gradients are then summed over the mesh axes
that replicate the parameter (the runtime's gradient sync).

**The output boundary.** Inside the graph a gradient is held as summands over the mesh
axes on which its tensor is replicated, and exactly (each device its own piece's) over the
axes on which it is sharded. The user's loss on each rank yields the whole gradient of the
piece that rank holds: for whole outputs every rank computes the same global loss, for
sharded outputs each rank computes its summand of the global loss from its local pieces
(ranks holding the same piece, along replicated axes, compute the same term). Either way
``n`` devices along each replicated axis each hold the full gradient of the same piece, so
the boundary multiplies it by ``1/n`` per replicated axis and leaves sharded axes alone;
whole outputs get ``1/(mesh size)``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar_passes import local_ops
from autopar_passes.annotation import META_KEY
from autopar_passes.strategies.localize import localize
from autopar_passes.strategies.types import Strategy
from autopar_passes.trace import TracedModel
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import REPLICATE, Layout, Partial, Replicate, Shard
from autopar_plans.reshard import AxisStep, plan_reshard

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass
class LoweredGraph:
    """One device's program and what the runtime must provide for it."""

    graph: torch.fx.Graph
    coords: tuple[int, ...]
    params: dict[str, str] = field(default_factory=dict)  # get_attr target -> param name
    buffers: dict[str, str] = field(default_factory=dict)  # get_attr target -> buffer name
    constants: dict[str, str] = field(default_factory=dict)
    collectives: dict[str, tuple[str, int]] = field(default_factory=dict)  # module -> kind, axis
    counts: dict[str, int] = field(default_factory=dict)  # collective kind -> calls in forward
    outputs: list[Layout | None] = field(default_factory=list)  # per flat output; None: no tensor
    # lowered node -> the traced node whose value it computes (ops, getitems, user inputs);
    # reshards and local steps have none (``autopar_passes.lower_stages`` places them by consumer)
    sources: dict[torch.fx.Node, str] = field(default_factory=dict)
    # the last node of each reshard -> (the traced node resharded, the layout it is made
    # into): what the plan's ledger (``autopar_passes.ledger``) calls that reshard
    reshards: dict[str, tuple[str, Layout]] = field(default_factory=dict)


def lower_spmd(
    traced: TracedModel,
    strategy_of: Callable[[str], Strategy],
    layout_of: Callable[[str, int], Layout],
    mesh: MeshSpec,
    coords: tuple[int, ...],
    device: torch.device | None = None,
    *,
    sharded_outputs: bool = False,
) -> LoweredGraph:
    """The program of the device at ``coords``. ``strategy_of(node)`` gives each op's chosen
    strategy; ``layout_of(node, output)`` each node's output layout (parameters: their
    storage layout; user inputs: the layout they arrive in). ``sharded_outputs`` returns
    each output's local piece instead of the whole."""
    lowering = _Lowering(traced, strategy_of, layout_of, mesh, coords, device, sharded_outputs)
    return lowering.run()


def param_attr(name: str) -> str:
    return name


class _Lowering:
    def __init__(
        self,
        traced: TracedModel,
        strategy_of: Callable[[str], Strategy],
        layout_of: Callable[[str, int], Layout],
        mesh: MeshSpec,
        coords: tuple[int, ...],
        device: torch.device | None,
        sharded_outputs: bool = False,
    ) -> None:
        self.traced = traced
        self.sharded_outputs = sharded_outputs
        self.strategy_of = strategy_of
        self.layout_of = layout_of
        self.mesh = mesh
        self.coords = coords
        self.device = device
        self.out = LoweredGraph(torch.fx.Graph(), coords)
        # (node name, output index, layout) -> local value in that layout
        self.values: dict[tuple[str, int, Layout], torch.fx.Node] = {}
        self.layout: dict[tuple[str, int], Layout] = {}
        self.local: dict[str, torch.fx.Node] = {}
        signature = traced.exported.graph_signature
        self.param_of = {
            node: traced_param
            for traced_param, info in traced.params.items()
            for node in info.nodes
        }
        self.buffer_of = dict(signature.inputs_to_buffers)
        self.constant_of = dict(signature.inputs_to_lifted_tensor_constants)

    # ---- driver -------------------------------------------------------------------
    def run(self) -> LoweredGraph:
        for node in self.traced.graph.nodes:
            note = node.meta[META_KEY]
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "output":
                self._output(node)
            elif node.target is operator.getitem:
                parent = node.args[0]
                index = int(node.args[1])  # type: ignore[arg-type]
                value = self.out.graph.call_function(
                    operator.getitem, (self.local[parent.name], index)
                )
                self.out.sources[value] = node.name
                self._define(node.name, value, self.layout[(parent.name, index)])
            elif not note.outputs:
                continue  # asserts on metadata: nothing to run
            else:
                self._op(node)
        self.out.graph.lint()
        return self.out

    def _define(self, name: str, value: torch.fx.Node, layout: Layout, index: int = 0) -> None:
        if index == 0:
            self.local[name] = value
        self.layout[(name, index)] = layout
        self.values[(name, index, layout)] = value

    def _placeholder(self, node: torch.fx.Node) -> None:
        graph = self.out.graph
        if node.name in self.param_of:
            name = self.param_of[node.name]
            target = param_attr(name)
            self.out.params[target] = name
            value = graph.get_attr(target)
            self._define(node.name, value, self.layout_of(node.name, 0))
        elif node.name in self.buffer_of:
            target = self.buffer_of[node.name]
            self.out.buffers[target] = target
            self._define(node.name, graph.get_attr(target), self._replicated())
        elif node.name in self.constant_of:
            target = self.constant_of[node.name]
            self.out.constants[target] = target
            self._define(node.name, graph.get_attr(target), self._replicated())
        else:
            value = graph.placeholder(node.name)
            self.out.sources[value] = node.name
            self._define(node.name, value, self.layout_of(node.name, 0))

    def _replicated(self) -> Layout:
        return Layout.replicated(self.mesh.ndim)

    def _op(self, node: torch.fx.Node) -> None:
        strategy = self.strategy_of(node.name)
        inputs = iter(strategy.inputs)

        def fetch(value: Any) -> Any:
            if isinstance(value, torch.fx.Node):
                if isinstance(value.meta.get("val"), torch.Tensor):
                    return self._value(value.name, 0, next(inputs))
                return self.local.get(value.name, value)
            if isinstance(value, list | tuple):
                return type(value)(fetch(v) for v in value)
            if isinstance(value, dict):
                return {k: fetch(v) for k, v in value.items()}
            if isinstance(value, torch.device):
                return self.device or value
            return value

        args = fetch(node.args)
        kwargs = fetch(dict(node.kwargs))
        from autopar_passes.strategies.graph import op_call

        call = op_call(node)
        fn, local_args, local_kwargs = localize(
            call, strategy, args, kwargs, self.coords, self.mesh.shape
        )
        if strategy.local.kind == "scale":
            inner = self.out.graph.call_function(node.target, local_args, local_kwargs)
            value = self.out.graph.call_function(local_ops.scale, (inner, strategy.local.params[0]))
        else:
            value = self.out.graph.call_function(fn, local_args, local_kwargs)
        value.name = node.name
        self.out.sources[value] = node.name
        for index, layout in enumerate(strategy.outputs):
            self.layout[(node.name, index)] = layout
        self.local[node.name] = value
        if len(strategy.outputs) == 1:
            self.values[(node.name, 0, strategy.outputs[0])] = value

    def _output(self, node: torch.fx.Node) -> None:
        def convert(value: Any) -> Any:
            if isinstance(value, torch.fx.Node):
                if not isinstance(value.meta.get("val"), torch.Tensor):
                    self.out.outputs.append(None)
                    return self.local.get(value.name)
                want = self._output_layout(self.layout[(value.name, 0)])
                self.out.outputs.append(want)
                local = self._value(value.name, 0, want)
                copies = math.prod(
                    size
                    for size, p in zip(self.mesh.shape, want, strict=True)
                    if isinstance(p, Replicate)
                )
                if value.meta[META_KEY].requires_grad and copies > 1:
                    return self.out.graph.call_function(local_ops.scale_grad, (local, 1.0 / copies))
                return local
            if isinstance(value, list | tuple):
                return type(value)(convert(v) for v in value)
            return value

        self.out.graph.output(convert(node.args[0]))

    def _output_layout(self, have: Layout) -> Layout:
        """Whole, or (sharded outputs) ``have`` with its partial sums completed."""
        if not self.sharded_outputs:
            return self._replicated()
        return Layout(*(REPLICATE if isinstance(p, Partial) else p for p in have))

    # ---- resharding ---------------------------------------------------------------
    def _value(self, name: str, index: int, want: Layout) -> torch.fx.Node:
        """The local value of output ``index`` of ``name`` in layout ``want``."""
        cached = self.values.get((name, index, want))
        if cached is not None:
            return cached
        have = self.layout[(name, index)]
        source = self.values.get((name, index, have))
        if source is None:  # an output of a multi-output op, reached through getitem
            source = self.out.graph.call_function(operator.getitem, (self.local[name], index))
            self.values[(name, index, have)] = source
        value = self._reshard(source, have, want)
        self.values[(name, index, want)] = value
        if value is not source and index == 0:
            self.out.reshards[value.name] = (name, want)
        return value

    def _reshard(self, x: torch.fx.Node, have: Layout, want: Layout) -> torch.fx.Node:
        return emit_reshard(
            self.out.graph, x, have, want, self.coords, self.mesh.shape, self._collective
        )

    def _collective(self, kind: str, axis: int, *args: Any) -> torch.fx.Node:
        name = f"{kind}_{self.mesh.axis_names[axis]}"
        self.out.collectives[name] = (kind, axis)
        self.out.counts[kind] = self.out.counts.get(kind, 0) + 1
        return self.out.graph.call_module(name, args)


def emit_reshard(
    graph: torch.fx.Graph,
    x: torch.fx.Node,
    have: Layout,
    want: Layout,
    coords: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    collective: Callable[..., torch.fx.Node],
) -> torch.fx.Node:
    """Append to ``graph`` what the device at ``coords`` runs to turn ``x`` from ``have``
    into ``want``: the planner's steps (``autopar_plans.reshard``), the ones the cost model priced.
    ``collective(kind, axis, x, *dims)`` adds a collective's node."""
    if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in (*have, *want)):
        raise NotImplementedError(f"only partial sums are lowered, not {have} -> {want}")
    for step in plan_reshard(have, want):
        if step.local:
            fn, args = local_step(step, coords, mesh_shape)
            x = graph.call_function(fn, (x, *args))
        else:
            x = collective(step.kind, step.axis, x, *step.dims)
    return x


def local_step(
    step: AxisStep, coords: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> tuple[Callable[..., torch.Tensor], tuple[int, ...]]:
    """The ``local_ops`` function and its arguments after the tensor that the device at
    ``coords`` runs for a local reshard step (slice, zero or pad)."""
    axis = step.axis
    if step.kind == "slice":
        return local_ops.shard_slice, (step.dims[0], coords[axis], mesh_shape[axis])
    if step.kind == "pad":
        return local_ops.zero_pad, (step.dims[0], coords[axis], mesh_shape[axis])
    if step.kind == "zero":
        return local_ops.zero_unless_first, (coords[axis],)
    raise ValueError(f"{step.kind} is not a local step")


def local_shard(
    tensor: torch.Tensor, layout: Layout, coords: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> torch.Tensor:
    """This device's piece of a whole tensor in ``layout`` (Partial: the first device holds
    the value, the others zeros)."""
    piece = tensor
    for axis, placement in enumerate(layout):
        if isinstance(placement, Shard):
            piece = piece.chunk(mesh_shape[axis], dim=placement.dim)[coords[axis]]
        elif isinstance(placement, Partial) and coords[axis] != 0:
            piece = torch.zeros_like(piece)
    return piece.contiguous()


def world_coords(mesh: MeshSpec) -> list[tuple[int, ...]]:
    return [mesh.coordinates(rank) for rank in range(math.prod(mesh.shape))]
