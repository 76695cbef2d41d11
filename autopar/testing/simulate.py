"""Run every rank's lowered program in one process, with simulated collectives.

For debugging and fast tests: each rank runs in a thread; the collective modules the lowered
graph calls meet at a barrier and exchange their tensors in memory. Every node's local value
is recorded, so a layout mistake can be found at the first node where the pieces, put back
together by their layout, stop matching the single-device value (``first_mismatch``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopar_passes.from_plan import PlanLayouts
from autopar_passes.lower_spmd import emit_reshard, local_shard, lower_spmd
from autopar_passes.trace import TracedModel
from autopar_plans.placement import Layout, Partial, Replicate, Shard
from autopar_plans.plan import Plan


class _Exchange:
    """A meeting point for the ranks along one mesh axis, one collective at a time."""

    def __init__(self, members: list[int]) -> None:
        self.members = members
        self.barrier = threading.Barrier(len(members))
        self.values: dict[int, torch.Tensor] = {}

    def gather(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        self.values[rank] = value.detach()
        self.barrier.wait()
        result = [self.values[m] for m in self.members]
        self.barrier.wait()
        return result


class _SimCollective(nn.Module):
    def __init__(self, kind: str, exchange: _Exchange, rank: int) -> None:
        super().__init__()
        self.kind, self.exchange, self.rank = kind, exchange, rank

    def forward(self, x: torch.Tensor, *dims: int) -> torch.Tensor:
        parts = self.exchange.gather(self.rank, x)
        return collective_result(self.kind, parts, self.exchange.members.index(self.rank), dims)


def collective_result(
    kind: str, parts: list[torch.Tensor], index: int, dims: tuple[int, ...]
) -> torch.Tensor:
    """What member ``index`` of a group receives from collective ``kind`` over the members'
    ``parts``, with the dims the lowering passes it (gather/scatter dim; all-to-all: from,
    to)."""
    n = len(parts)
    if kind == "all_reduce":
        return torch.stack(parts).sum(0)
    if kind == "all_gather":
        return torch.cat(parts, dim=dims[0])
    if kind == "reduce_scatter":
        return torch.stack(parts).sum(0).chunk(n, dim=dims[0])[index]
    if kind == "all_to_all":
        src, dst = dims
        return torch.cat([p.chunk(n, dim=dst)[index] for p in parts], dim=src)
    raise ValueError(kind)


def simulate(
    traced: TracedModel, plan: Plan, model: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> dict[tuple[int, ...], dict[str, Any]]:
    """Every rank's recorded node values (forward only) for ``plan`` on ``inputs``.

    With pipeline stages, the layouts hold on one stage's mesh: the whole graph runs there
    (the stage split itself is tested on real ranks)."""
    mesh = plan.stage_mesh or plan.mesh
    layouts = PlanLayouts(traced, plan)
    exchanges: dict[tuple[int, tuple[int, ...]], _Exchange] = {}
    ranks = list(range(mesh.size))
    for rank in ranks:
        coords = mesh.coordinates(rank)
        for axis in range(mesh.ndim):
            key = (axis, coords[:axis] + coords[axis + 1 :])
            exchanges.setdefault(key, _Exchange([]))
            exchanges[key].members.append(rank)
    for exchange in exchanges.values():
        exchange.barrier = threading.Barrier(len(exchange.members))
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    records: dict[tuple[int, ...], dict[str, Any]] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        coords = mesh.coordinates(rank)
        lowered = lower_spmd(traced, layouts.strategy, layouts.layout, mesh, coords)
        root = nn.Module()
        for target, name in lowered.params.items():
            full = params[name].detach()
            if name in traced.reshaped:
                full = full.reshape(traced.reshaped[name][1])
            _set(root, target, local_shard(full, plan.params[name].param, coords, mesh.shape))
        for target, name in lowered.buffers.items():
            _set(root, target, buffers[name])
        for target, name in lowered.constants.items():
            _set(root, target, traced.exported.constants[name])
        for module, (kind, axis) in lowered.collectives.items():
            key = (axis, coords[:axis] + coords[axis + 1 :])
            root.add_module(module, _SimCollective(kind, exchanges[key], rank))
        program = torch.fx.GraphModule(root, lowered.graph)
        seen: dict[str, Any] = {}
        interpreter = _Recorder(program, seen)
        try:
            interpreter.run(*inputs)
        except BaseException as error:
            errors.append(error)
            for exchange in exchanges.values():
                exchange.barrier.abort()
        records[coords] = seen

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return records


class _Recorder(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, seen: dict[str, Any]) -> None:
        super().__init__(module)
        self.seen = seen

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        self.seen[n.name] = value
        return value


def _set(root: nn.Module, dotted: str, value: torch.Tensor) -> None:
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_buffer(leaf, value)


def reference_values(
    traced: TracedModel, model: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> dict[str, Any]:
    """Every node's value on one device (parameters in their planned shapes)."""
    signature = traced.exported.graph_signature
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    values = []
    for name in signature.parameters:
        value = params[name].detach()
        values.append(value.reshape(traced.reshaped[name][1]) if name in traced.reshaped else value)
    values += [buffers[name] for name in signature.buffers]
    seen: dict[str, Any] = {}
    _Recorder(traced.graph_module, seen).run(*values, *inputs)
    return seen


def first_mismatch(
    traced: TracedModel,
    plan: Plan,
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    close: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
) -> tuple[str, str] | None:
    """The first node (graph order) whose pieces do not reassemble to the single-device
    value, with its layout; None when all agree."""
    close = close or (
        lambda a, b: a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    )
    records = simulate(traced, plan, model, inputs)
    reference = reference_values(traced, model, inputs)
    layouts = PlanLayouts(traced, plan)
    mesh = plan.stage_mesh or plan.mesh
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.name not in reference:
            continue
        want = reference[node.name]
        if not isinstance(want, torch.Tensor) or (node.name, 0) not in layouts.layouts:
            continue
        layout = layouts.layout(node.name)
        pieces = {coords: record.get(node.name) for coords, record in records.items()}
        if any(not isinstance(p, torch.Tensor) for p in pieces.values()):
            continue
        got = _assemble(pieces, layout, mesh.shape, ())
        if got is None or not close(got, want):
            return node.name, f"{node.target} {layout}"
    return None


def simulated_value(
    traced: TracedModel,
    plan: Plan,
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    node: str,
) -> torch.Tensor | None:
    """Node ``node``'s pieces on every simulated device, reassembled by its layout (None
    when a device has none). Unlike ``first_mismatch``, which compares every node, this
    reads one: a tensor written in place later holds its final value, not its own."""
    records = simulate(traced, plan, model, inputs)
    mesh = plan.stage_mesh or plan.mesh
    layout = PlanLayouts(traced, plan).layout(node)
    pieces = {coords: record.get(node) for coords, record in records.items()}
    if any(not isinstance(p, torch.Tensor) for p in pieces.values()):
        return None
    return _assemble(pieces, layout, mesh.shape, ())


def _assemble(
    pieces: dict[tuple[int, ...], torch.Tensor],
    layout: Layout,
    mesh_shape: tuple[int, ...],
    prefix: tuple[int, ...],
) -> torch.Tensor | None:
    axis = len(prefix)
    if axis == len(mesh_shape):
        return pieces[prefix]
    parts = [_assemble(pieces, layout, mesh_shape, (*prefix, c)) for c in range(mesh_shape[axis])]
    if any(p is None for p in parts):
        return None
    placement = layout[axis]
    if isinstance(placement, Shard):
        return torch.cat(parts, dim=placement.dim)  # type: ignore[arg-type]
    if isinstance(placement, Partial):
        return torch.stack(parts).sum(0)  # type: ignore[arg-type]
    assert isinstance(placement, Replicate)
    return parts[0]


class _Program:
    """One device's emitted reshard, as the calls ``emit_reshard`` appends (it takes this in
    place of an ``fx.Graph``): each call's value is its index; ``-1`` is the input."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def call_function(self, fn: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> int:
        self.calls.append((fn, args))
        return len(self.calls) - 1

    def collective(self, kind: str, axis: int, x: int, *dims: int) -> int:
        self.calls.append(((kind, axis), (x, *dims)))
        return len(self.calls) - 1


def simulate_reshard(
    pieces: dict[tuple[int, ...], torch.Tensor],
    have: Layout,
    want: Layout,
    mesh_shape: tuple[int, ...],
) -> dict[tuple[int, ...], torch.Tensor]:
    """Every device's result of the lowered reshard ``have -> want`` of its piece.

    Each device's program is emitted by the lowering (``emit_reshard``, its coordinates
    baked in), and all run in lockstep, call by call, a collective meeting the same call of
    the other devices along its axis."""
    devices = sorted(pieces)
    programs: dict[tuple[int, ...], _Program] = {}
    for coords in devices:
        program = _Program()
        emit_reshard(program, -1, have, want, coords, mesh_shape, program.collective)  # type: ignore[arg-type]
        programs[coords] = program
    values = {c: {-1: pieces[c]} for c in devices}
    for index in range(len(programs[devices[0]].calls)):
        for coords in devices:
            fn, (x, *args) = programs[coords].calls[index]
            if callable(fn):
                values[coords][index] = fn(values[coords][x], *args)
        for coords in devices:
            what, (x, *dims) = programs[coords].calls[index]
            if callable(what):
                continue
            kind, axis = what
            line = coords[:axis] + coords[axis + 1 :]
            group = [c for c in devices if c[:axis] + c[axis + 1 :] == line]
            parts = [values[c][x] for c in group]
            values[coords][index] = collective_result(kind, parts, group.index(coords), tuple(dims))
    last = len(programs[devices[0]].calls) - 1
    return {c: values[c][last] for c in devices}
