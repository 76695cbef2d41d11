"""Strategies for every node of a traced graph.

Reads the annotated graph (``node.meta["autopar"]``) and the rule table; writes one
``NodeChoices`` per node that needs a decision or follows one:

- an op with a rule gets the rule's strategies; an op without one, or whose rule offers
  nothing valid, gets replicate-all and one warning naming the op;
- a parameter gets every layout of its shape that splits evenly (its *storage* layout: a
  layout sharded where its consumers need it whole is FSDP, the consumer's edge gathers it);
- a user input, buffer or constant is replicated (every rank holds the full batch; a
  consumer that wants a shard slices it for free), and an in-place op on one takes it as
  it is (``_mutating_held_state``);
- ``getitem`` follows its producer (one strategy per producer strategy);
- nodes without tensor outputs (``_assert_tensor_metadata``) are dropped.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from autopar_passes.annotation import META_KEY, NodeAnnotation, TensorInfo
from autopar_passes.strategies.inplace import mutates_first_input
from autopar_passes.strategies.table import rule_for
from autopar_passes.strategies.types import OpCall, Strategy, replicate_all
from autopar_plans.placement import REPLICATE, Layout, Placement, Shard

if TYPE_CHECKING:
    from autopar_passes.trace import TracedModel


@dataclass(frozen=True, slots=True)
class TensorInput:
    """A tensor input of a node: which node produces it and which of that node's outputs."""

    producer: str
    index: int


@dataclass
class NodeChoices:
    """The strategies one node may take, and where its tensor inputs come from."""

    name: str
    kind: str  # "op", "param", "input", "buffer", "constant", "getitem", "output"
    strategies: list[Strategy]
    inputs: list[TensorInput]
    call: OpCall | None = None
    note: NodeAnnotation | None = None
    # for an op: per tensor input, the parameter it reads directly (a parameter
    # placeholder), else None; what ``autopar_passes.experts`` reads to find expert weights
    params: tuple[str | None, ...] = ()


# node.meta key of the node's ``OpCall`` with the arguments it was made from: each solve
# of the pipeline search (one per stage count) reads every node's call again
_CALL_KEY = "autopar_call"


def op_call(node: torch.fx.Node) -> OpCall:
    """The ``OpCall`` a rule sees for an fx node (tensors replaced by their TensorInfo);
    made once per node and its arguments (a pass that rewrites them gets a new one)."""
    kept = node.meta.get(_CALL_KEY)
    if kept is not None and kept[0] is node.args and kept[1] is node.kwargs:
        return kept[2]
    call = _make_call(node)
    node.meta[_CALL_KEY] = (node.args, node.kwargs, call)
    return call


def _make_call(node: torch.fx.Node) -> OpCall:
    inputs: list[TensorInfo] = []

    def convert(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                info = _info(val)
                inputs.append(info)
                return info
            return val
        if isinstance(value, list | tuple):
            return type(value)(convert(v) for v in value)
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    args = convert(node.args)
    kwargs = convert(dict(node.kwargs))
    note: NodeAnnotation = node.meta[META_KEY]
    return OpCall(node.target, args, kwargs, tuple(inputs), note.outputs, node.name)


def tensor_inputs(node: torch.fx.Node) -> list[TensorInput]:
    """The producers of ``node``'s tensor inputs, in flattened order (args, then kwargs)."""
    found: list[TensorInput] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.fx.Node):
            if isinstance(value.meta.get("val"), torch.Tensor):
                found.append(TensorInput(value.name, 0))
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    visit(node.args)
    visit(node.kwargs)
    return found


def traced_choices(
    traced: TracedModel, mesh_shape: tuple[int, ...]
) -> tuple[dict[str, NodeChoices], list[str]]:
    """``graph_choices`` of a traced model's graph, made once per mesh shape: the search
    solves a stage count's mesh, and the plan, its program and the ledger read it again
    (llama3-8b of 96 layers on 8x8: three walks of 8,569 nodes, where one serves)."""
    shape = tuple(mesh_shape)
    return traced.derived(("graph_choices", shape), lambda: graph_choices(traced.graph, shape))


def graph_choices(
    graph: torch.fx.Graph, mesh_shape: tuple[int, ...]
) -> tuple[dict[str, NodeChoices], list[str]]:
    """Strategies of every node, in graph order, and warnings for ops replicated."""
    choices: dict[str, NodeChoices] = {}
    warnings: list[str] = []
    unknown: dict[str, int] = {}
    replicated = Layout.replicated(len(mesh_shape))
    made: dict[tuple[object, ...], list[Strategy]] = {}
    for node in graph.nodes:
        note: NodeAnnotation = node.meta[META_KEY]
        if node.op == "output":
            ins = _output_inputs(node)
            choices[node.name] = NodeChoices(
                node.name, "output", [Strategy((replicated,) * len(ins), ())], ins, note=note
            )
            continue
        if not note.outputs:
            continue
        if node.op == "placeholder":
            kind = note.kind
            if kind == "param":
                key = ("param", note.outputs[0].shape)
                if key not in made:
                    made[key] = [
                        Strategy((), (layout,), split=layout.shard_factor(mesh_shape))
                        for layout in storage_layouts(note.outputs[0], mesh_shape)
                    ]
                strategies = made[key]
            else:
                strategies = [Strategy((), (replicated,))]
            choices[node.name] = NodeChoices(node.name, kind, strategies, [], note=note)
            continue
        if node.target is operator.getitem:
            parent = node.args[0]
            assert isinstance(parent, torch.fx.Node)
            index = int(node.args[1])  # type: ignore[arg-type]
            choices[node.name] = NodeChoices(
                node.name, "getitem", [], [TensorInput(parent.name, index)], note=note
            )
            continue
        call = op_call(node)
        rule = rule_for(node.target)
        key = (str(node.target), repr(call.args), repr(call.kwargs), call.outputs)
        if key not in made:  # identical layers repeat identical calls: one rule call each
            made[key] = list(rule(call, mesh_shape)) if rule is not None else []
        strategies = made[key]
        if not strategies:
            strategies = [replicate_all(call, mesh_shape)]
            unknown[str(node.target)] = unknown.get(str(node.target), 0) + 1
        inputs = tensor_inputs(node)
        if inputs and mutates_first_input(node.target):
            source = choices.get(inputs[0].producer)
            strategies = _mutating_held_state(strategies, source, call, mesh_shape)
        params = tuple(_param_of(choices.get(i.producer)) for i in inputs)
        choices[node.name] = NodeChoices(
            node.name, "op", strategies, inputs, call=call, note=note, params=params
        )
    for op, count in unknown.items():
        warnings.append(
            f"no sharding rule for {op} ({count} node{'s' if count > 1 else ''}): replicated "
            "on every device"
        )
    return choices, warnings


def _mutating_held_state(
    strategies: list[Strategy],
    source: NodeChoices | None,
    call: OpCall,
    mesh_shape: tuple[int, ...],
) -> list[Strategy]:
    """An in-place op on a buffer or an input, which every rank holds whole: only the
    strategies that take it replicated (a reshard would write into a copy, and the buffer
    would keep its old value)."""
    if source is None or source.kind not in ("input", "buffer", "constant"):
        return strategies
    kept = [s for s in strategies if s.inputs[0].is_replicated]
    return kept or [replicate_all(call, mesh_shape)]


def _param_of(choices: NodeChoices | None) -> str | None:
    """The parameter a tensor input is: a parameter placeholder, or a view of one (a
    transformers-5 expert weight reaches its grouped matmul transposed)."""
    if choices is None or choices.note is None:
        return None
    if choices.kind == "param":
        return choices.note.param
    if choices.kind == "op" and choices.note.kind == "view" and len(choices.params) == 1:
        return choices.params[0]
    return None


def storage_layouts(info: TensorInfo, mesh_shape: tuple[int, ...]) -> list[Layout]:
    """Every layout that splits a parameter of this shape evenly: per mesh axis, replicate
    or shard one dim (several axes may shard the same dim)."""
    options: list[Placement] = [REPLICATE] + [Shard(d) for d in range(len(info.shape))]
    layouts = []
    for picks in itertools.product(options, repeat=len(mesh_shape)):
        layout = Layout(*picks)
        if layout.divides(info.shape, mesh_shape):
            layouts.append(layout)
    return layouts


def _output_inputs(node: torch.fx.Node) -> list[TensorInput]:
    found: list[TensorInput] = []
    for value in _leaves(node.args[0]):
        if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            found.append(TensorInput(value.name, 0))
    return found


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _info(val: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch."))
