"""Export a model's repeated layers once: trace layers 0 to 2, and make the others from
layer 2.

``torch.export`` spends about 2 ms per op running the model's Python on fake tensors:
llama3-8b's 32 layers took 5.7 s of its 6.5 s trace, and the time grew with depth. A
transformer repeats one block, so layer ``i``'s program is layer 2's with its own
parameters, reading layer ``i - 1`` where layer 2 reads layer 1. This pass exports the
whole model with layers 3 to ``L - 1`` standing in: each returns new empty tensors shaped
as layer 2's outputs, so the model's own code around the layer calls (the embedding, a
sum of per-layer router losses, the head) runs and is traced as written. Each stand-in's
nodes are then replaced by a copy of layer 2 that reads its own parameters (already in
the program: export lifts every parameter) and the layer before. Node names come from the
graph's namespace in graph order, as export's do, so the program equals a full export
node for node (``tests/passes/test_trace_once.py`` compares them).

It applies only where the copy is sure to be what a full export gives (otherwise the whole
model is exported, as before):

- the layer container (the outermost ``ModuleList`` or ``Sequential`` of at least
  ``MIN_LAYERS`` children of one class) holds layers whose modules agree in everything but
  their tensors' values: the same submodules, parameter and buffer names, shapes and dtypes,
  the same plain attributes (an attribute holding the layer's own index, as Hugging Face's
  ``layer_idx``, excepted), no hooks, no tensor shared between layers;
- every layer is called once, each from 3 on as layer 2 was, one layer on: where layer 2
  took layer 1's output, the layer before's; anything else, the same objects (code of the
  model's that changes a layer's input by index shows here);
- layers 1 and 2 export to the same program: the same ops, shapes, dtypes and arguments,
  layer 2 reading layer 1 exactly where layer 1 reads layer 0, and otherwise only its own
  nodes and nodes made before the layers;
- each layer's ops are one run of the graph, and the layers hold no constants and no
  submodules (a higher-order op's body).

Fake tensors: each copy gets its own, aliased as layer 2's are (a view of a layer's own
output views the copy's), because the annotate pass attributes saved bytes by storage.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    TensorArgument,
)
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_map_only

from autopar_passes.layers import LayerContainer, module_path
from autopar_passes.probe import storage_id, tensor_leaves

TRACED = 3  # layers exported: the first, and two to compare
MIN_LAYERS = 5  # below this the full export is about as fast
_SUFFIX = re.compile(r"_\d+$")
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)

Export = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], torch.export.ExportedProgram]


def export_layers_once(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], export: Export
) -> torch.export.ExportedProgram | None:
    """The model's program with its repeated layers traced once, or None where that is not
    sure to equal ``export(model, args, kwargs)`` (module docstring)."""
    found = _repeated_layers(model)
    if found is None:
        return None
    path, layers = found
    calls: dict[int, tuple[Any, list[Any], Any]] = {}  # layer -> (spec, inputs, output)

    def recorded(index: int, run: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*a: Any, **k: Any) -> Any:
            inputs, spec = tree_flatten((a, k))
            calls[index] = (spec, inputs, run(*a, **k))
            return calls[index][2]

        return forward

    def stand_in(*a: Any, **k: Any) -> Any:
        # new tensors shaped as the last traced layer's outputs: the model's own code
        # around the layer calls runs as written, and shows in the graph
        return tree_map_only(torch.Tensor, torch.empty_like, calls[TRACED - 1][2])

    for index in range(1, len(layers)):
        layer = layers[index]
        run = layer.forward if index < TRACED else stand_in
        layer.forward = recorded(index, run)  # type: ignore[method-assign]
    try:
        small = export(model, args, kwargs)
    except Exception:  # the full export says what is wrong, in its own words
        return None
    finally:
        for layer in layers[1:]:
            del layer.forward
    try:
        _check_calls(calls, len(layers))
        return _stamp(small, path, len(layers))
    except _NotStamped:
        return None


def _check_calls(calls: dict[int, tuple[Any, list[Any], Any]], count: int) -> None:
    """Each layer from 3 on was called once, as layer 2 was, one layer on: where layer 2
    took layer 1's output, the layer before's; where it took anything else, the same."""
    if sorted(calls) != list(range(1, count)):
        raise _NotStamped("a layer was not called, or called again")
    first_out = tree_flatten(calls[1][2])[0]
    spec, inputs, _ = calls[TRACED - 1]
    for index in range(TRACED, count):
        their_spec, theirs, _ = calls[index]
        if their_spec != spec or len(theirs) != len(inputs):
            raise _NotStamped(f"layer {index} is called differently")
        previous_out = tree_flatten(calls[index - 1][2])[0]
        for mine, their in zip(inputs, theirs, strict=True):
            produced = [k for k, out in enumerate(first_out) if out is mine]
            if produced:
                ok = their is previous_out[produced[0]]
            elif isinstance(mine, torch.Tensor):
                ok = their is mine
            else:
                ok = type(their) is type(mine) and their == mine
            if not ok:
                raise _NotStamped(f"layer {index} reads other inputs than layer 2 did")


def _repeated_layers(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """(path, layers) of the outermost container of identical layers."""
    if _global_hooks():
        return None
    found: list[tuple[int, int, str, nn.Module]] = []
    for path, module in model.named_modules():
        if type(module) not in (nn.ModuleList, nn.Sequential) or len(module) < MIN_LAYERS:
            continue
        if len({type(child) for child in module}) == 1:
            found.append((path.count("."), -len(module), path, module))
    if not found:
        return None
    _, _, path, container = min(found, key=lambda f: (f[0], f[1]))
    layers = list(container)
    return (path, layers) if _identical(layers, model, path) else None


def _global_hooks() -> bool:
    hooks = nn.modules.module
    return any(
        getattr(hooks, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )


def _identical(layers: list[nn.Module], model: nn.Module, path: str) -> bool:
    """Whether the layers differ in nothing but their tensors' values (module docstring)."""
    shapes = [_structure(layer) for layer in layers]
    if shapes[0] is None or any(s != shapes[0] for s in shapes):
        return False
    attributes = [_attributes(layer) for layer in layers]
    if any(a.keys() != attributes[0].keys() for a in attributes):
        return False
    for key in attributes[0]:
        values = [a[key] for a in attributes]
        if all(_same(v, values[0]) for v in values):
            continue
        if not all(isinstance(v, int) and v == i for i, v in enumerate(values)):
            return False  # differs, and is not the layer's own index
    # a tensor shared between layers (or with the rest of the model) would be copied apart:
    # every name of each layer's tensor lies in that layer
    inside = {id(t): i for i, layer in enumerate(layers) for t in _tensors_of(layer)}
    prefix = f"{path}." if path else ""
    return all(
        name.startswith(f"{prefix}{inside[id(tensor)]}.")
        for name, tensor in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
        if id(tensor) in inside
    )


def _tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _structure(layer: nn.Module) -> tuple[Any, ...] | None:
    """The submodules' classes, parameters and buffers (names, shapes, dtypes); None when a
    module has hooks (they may act per layer)."""
    items: list[Any] = []
    for name, module in layer.named_modules():
        if any(
            getattr(module, hooks, None)
            for hooks in (
                "_forward_hooks",
                "_forward_pre_hooks",
                "_backward_hooks",
                "_backward_pre_hooks",
                "_state_dict_hooks",
            )
        ):
            return None
        params = tuple(
            (n, tuple(p.shape), p.dtype, p.requires_grad)
            for n, p in module._parameters.items()
            if p is not None
        )
        buffers = tuple(
            (n, tuple(b.shape), b.dtype, n in module._non_persistent_buffers_set)
            for n, b in module._buffers.items()
            if b is not None
        )
        items.append((name, type(module), params, buffers))
    return tuple(items)


def _attributes(layer: nn.Module) -> dict[tuple[str, str], Any]:
    """Every submodule's own attributes but its tensors, submodules and hooks."""
    found: dict[tuple[str, str], Any] = {}
    for name, module in layer.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_") or key == "training":
                continue
            found[(name, key)] = value
    return found


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        return type(a) is type(b) and a == b
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return False  # other objects only when they are one object


@dataclass
class _Layers:
    """The traced graph split by layer: each layer's placeholders, then its ops, in order."""

    nodes: dict[int, list[torch.fx.Node]]
    layer_of: dict[torch.fx.Node, int]
    position_of: dict[torch.fx.Node, int]
    first_op: torch.fx.Node  # layer 0's first op: what runs before it runs once
    # a stand-in's node -> the position in the last traced layer of the output it stands for
    stand_in: dict[torch.fx.Node, int]

    def position(self, node: torch.fx.Node) -> tuple[int, int] | None:
        layer = self.layer_of.get(node)
        return None if layer is None else (layer, self.position_of[node])


def _split(small: torch.export.ExportedProgram, path: str, count: int) -> _Layers:
    container = LayerContainer(path, count)
    specs = {spec.arg.name: spec for spec in small.graph_signature.input_specs}
    nodes: dict[int, list[torch.fx.Node]] = {i: [] for i in range(count)}
    layer_of: dict[torch.fx.Node, int] = {}
    runs: list[int] = []  # the layer of each run of ops, in graph order
    for node in small.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            spec = specs.get(node.name)
            layer = container.index_of(spec.target) if spec and spec.target else None
            if layer is not None and spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
                raise _NotStamped("a constant of a layer")
        else:
            layer = container.index_of(module_path(node))
            if layer is not None and node.op != "call_function":
                raise _NotStamped("a submodule (a higher-order op's body) inside a layer")
            if layer is not None and (not runs or runs[-1] != layer):
                runs.append(layer)
        if layer is not None:
            nodes[layer].append(node)
            layer_of[node] = layer
    if runs != list(range(count)):
        raise _NotStamped("a layer's ops are not one run, in order")
    position_of = {node: i for layer in nodes.values() for i, node in enumerate(layer)}
    stand_in: dict[torch.fx.Node, int] = {}
    for layer in range(TRACED, count):
        for node in nodes[layer]:
            if node.op == "placeholder":
                continue
            source = node.args[0] if node.args else None
            if node.target != torch.ops.aten.empty_like.default or source not in position_of:
                raise _NotStamped("a stand-in made something else")
            if layer_of[source] != TRACED - 1:
                raise _NotStamped("a stand-in of another layer's output")
            stand_in[node] = position_of[source]
    first_op = next(n for n in nodes[0] if n.op != "placeholder")
    return _Layers(nodes, layer_of, position_of, first_op, stand_in)


def _check(split: _Layers, small: torch.export.ExportedProgram, path: str, count: int) -> None:
    """Layer 2 is layer 1's program one layer on, and every later layer has layer 2's
    placeholders (module docstring)."""
    one, two = split.nodes[1], split.nodes[2]
    targets = {spec.arg.name: spec.target or "" for spec in small.graph_signature.input_specs}
    order = {node: i for i, node in enumerate(small.graph.nodes)}
    before = order[split.first_op]

    def ref(value: Any, layer: int) -> Any:
        if isinstance(value, torch.fx.Node):
            where = split.position(value)
            if where is None:
                if value.op != "placeholder" and order[value] > before:
                    raise _NotStamped("a layer reads what runs between the layers")
                return ("outside", value)
            if where[0] == layer:
                return ("own", where[1])
            if where[0] == layer - 1:
                return ("previous", where[1])
            raise _NotStamped("a layer reads a layer other than the one before")
        if isinstance(value, list | tuple):
            return (type(value).__name__, tuple(ref(v, layer) for v in value))
        if isinstance(value, dict):
            return tuple(sorted((k, ref(v, layer)) for k, v in value.items()))
        return ("value", type(value).__name__, repr(value))

    def relative(node: torch.fx.Node, layer: int) -> str:
        return targets[node.name][len(f"{path}.{layer}") :]

    if len(one) != len(two):
        raise _NotStamped("layers 1 and 2 differ in length")
    for a, b in zip(one, two, strict=True):
        same = a.op == b.op and _vals(a) == _vals(b)
        if same and a.op == "placeholder":
            same = relative(a, 1) == relative(b, 2)
        elif same:
            same = (
                a.target == b.target
                and ref(a.args, 1) == ref(b.args, 2)
                and ref(a.kwargs, 1) == ref(b.kwargs, 2)
            )
        if not same:
            raise _NotStamped(f"layers 1 and 2 differ at {b.name}")
    params = [n for n in two if n.op == "placeholder"]
    for layer in range(TRACED, count):
        theirs = [n for n in split.nodes[layer] if n.op == "placeholder"]
        if [relative(n, layer) for n in theirs] != [relative(n, 2) for n in params] or [
            _vals(n) for n in theirs
        ] != [_vals(n) for n in params]:
            raise _NotStamped(f"layer {layer}'s parameters differ from layer 2's")


def _vals(node: torch.fx.Node) -> Any:
    """Shapes, strides, offsets and dtypes of the node's output(s)."""
    val = node.meta.get("val")
    if isinstance(val, list | tuple):
        return tuple(_vals_of(v) for v in val)
    return _vals_of(val)


def _vals_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype)
    return repr(value)


def _stamp(
    small: torch.export.ExportedProgram, path: str, count: int
) -> torch.export.ExportedProgram:
    split = _split(small, path, count)
    _check(split, small, path, count)
    return _Builder(small, split, path, count).build()


class _NotStamped(Exception):
    """What makes the copy unsure; the whole model is exported instead."""


class _Fakes:
    """Fake tensors for the copies of layer 2, aliased as layer 2's are: a tensor on a
    storage layer 2 makes lives on the copy's own; one on a storage of layer 2's parameter
    on the copy's parameter; one on a storage of layer 1 (the layer before) on the
    previous copy's; one on a storage from outside the layers stays."""

    def __init__(self, split: _Layers, graph: torch.fx.Graph) -> None:
        self.split = split
        # storage -> where it first appears: (layer, position, output index); None outside
        # the layers or in layer 0
        self.owner: dict[int, tuple[int, int, int] | None] = {}
        for node in graph.nodes:
            where = split.position(node)
            for k, tensor in enumerate(_tensors(node)):
                owner = (where[0], where[1], k) if where and where[0] > 0 else None
                self.owner.setdefault(storage_id(tensor), owner)
        self.bases: dict[tuple[int, int], torch.Tensor] = {}  # (copy, storage) -> meta base

    def copied(self, copy_index: int, node: torch.fx.Node) -> Any:
        """The value of layer 2's ``node`` in copy ``copy_index``."""
        return tree_map_only(
            torch.Tensor, lambda t: _view(self._source(copy_index, t), t), node.meta.get("val")
        )

    def kept(self, node: torch.fx.Node) -> Any:
        """The value of a node kept as traced: where it views a stand-in's output, the copy's."""

        def one(tensor: torch.Tensor) -> torch.Tensor:
            owner = self.owner.get(storage_id(tensor))
            if owner is None or owner[0] < TRACED:
                return tensor
            layer, position, _ = owner
            if self.split.nodes[layer][position].op == "placeholder":
                return tensor  # a later layer's parameter: kept as traced
            stands_for = self.split.nodes[TRACED - 1][
                self.split.stand_in[self.split.nodes[layer][position]]
            ]
            return _view(self._source(layer, _tensors(stands_for)[0]), tensor)

        return tree_map_only(torch.Tensor, one, node.meta.get("val"))

    def _source(self, copy_index: int, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor on the storage that ``tensor`` (of layer 2) lives on in the copy."""
        owner = self.owner.get(storage_id(tensor))
        if copy_index == TRACED - 1 or owner is None:
            return tensor
        layer, position, k = owner
        if layer == TRACED - 2:  # the layer before's: the previous copy's at the same place
            there = _tensors(self.split.nodes[TRACED - 1][position])[k]
            return self._source(copy_index - 1, there)
        if layer != TRACED - 1:
            raise _NotStamped("a view of a later layer")
        if self.split.nodes[layer][position].op == "placeholder":
            return _tensors(self.split.nodes[copy_index][position])[k]
        key = (copy_index, storage_id(tensor))
        if key not in self.bases:
            elements = tensor.untyped_storage().nbytes() // tensor.element_size()
            self.bases[key] = torch.empty_strided(
                (elements,), (1,), dtype=tensor.dtype, device="meta"
            )
        return self.bases[key]


def _view(source: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A fake tensor shaped as ``like`` on ``source``'s storage (the fake mode's dispatch
    skipped: 0.3 ms a tensor, a third of the time this pass saves)."""
    if source is like:
        return like
    if source.dtype != like.dtype:
        raise _NotStamped("a view of another dtype")
    with no_dispatch():
        view = source.as_strided(like.shape, like.stride(), like.storage_offset())
    return FakeTensor(like.fake_mode, view, like.device)  # type: ignore[attr-defined]


def _tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    return tensor_leaves(node.meta.get("val"))


class _Builder:
    """The whole program from the traced one: each stand-in replaced by a copy of layer 2."""

    def __init__(
        self, small: torch.export.ExportedProgram, split: _Layers, path: str, count: int
    ) -> None:
        self.small, self.split, self.path, self.count = small, split, path, count
        self.fakes = _Fakes(split, small.graph)
        self.graph = torch.fx.Graph()
        self.graph._codegen = copy.deepcopy(small.graph._codegen)
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        # layer -> its nodes in the new graph, at layer 2's positions
        self.copies: dict[int, list[torch.fx.Node]] = {c: [] for c in range(count)}
        self.container = LayerContainer(path, count)

    def build(self) -> torch.export.ExportedProgram:
        made_layers: set[int] = set()
        for node in self.small.graph.nodes:
            layer = self.split.layer_of.get(node)
            if node.op != "placeholder" and layer is not None and layer >= TRACED:
                if layer not in made_layers:
                    made_layers.add(layer)
                    self._copy_layer(layer)
                continue
            self._keep(node)
        return self._program()

    def _keep(self, node: torch.fx.Node) -> None:
        args = torch.fx.map_arg(node.args, self._read_kept)
        kwargs = torch.fx.map_arg(node.kwargs, self._read_kept)
        if node.op == "placeholder":
            made = self.graph.placeholder(node.name, type_expr=node.type)
        elif node.op == "output":
            made = self.graph.output(args[0], type_expr=node.type)
        else:
            name = _SUFFIX.sub("", node.name)  # numbered by the namespace, as export does
            made = self.graph.create_node(node.op, node.target, args, kwargs, name, node.type)
        made.meta = dict(node.meta)
        if node.op != "output":
            made.meta["val"] = self.fakes.kept(node)
        self.env[node] = made
        layer = self.split.layer_of.get(node)
        if layer is not None:
            self.copies[layer].append(made)

    def _read_kept(self, node: torch.fx.Node) -> torch.fx.Node:
        position = self.split.stand_in.get(node)
        if position is None:
            return self.env[node]
        return self.copies[self.split.layer_of[node]][position]

    def _copy_layer(self, c: int) -> None:
        for node in self.split.nodes[TRACED - 1]:
            if node.op == "placeholder":
                continue
            args = torch.fx.map_arg(node.args, lambda a: self._read_copy(a, c))
            kwargs = torch.fx.map_arg(node.kwargs, lambda a: self._read_copy(a, c))
            name = _SUFFIX.sub("", node.name)
            made = self.graph.create_node(node.op, node.target, args, kwargs, name, node.type)
            made.meta = dict(node.meta)
            made.meta["val"] = self.fakes.copied(c, node)
            stack = node.meta.get("nn_module_stack")
            if stack is not None:
                made.meta["nn_module_stack"] = {
                    self._renumber(key, c): (self._renumber(where, c), kind)
                    for key, (where, kind) in stack.items()
                }
            if self.container.index_of(module_path(made)) != c:
                raise _NotStamped("a module path")
            self.copies[c].append(made)

    def _read_copy(self, node: torch.fx.Node, c: int) -> torch.fx.Node:
        """What copy ``c`` reads where layer 2 reads ``node``."""
        where = self.split.position(node)
        if where is None:
            return self.env[node]
        layer, position = where
        return self.copies[c if layer == TRACED - 1 else c - 1][position]

    def _renumber(self, text: str, c: int) -> str:
        old = f"{self.path}.{TRACED - 1}"
        if text.endswith(old):
            return text[: -len(old)] + f"{self.path}.{c}"
        return text.replace(f"{old}.", f"{self.path}.{c}.", 1)

    def _program(self) -> torch.export.ExportedProgram:
        small = self.small
        (old,) = [n for n in small.graph.nodes if n.op == "output"]
        renamed = {
            n.name: self.env[n].name if n in self.env else self._read_kept(n).name
            for n in old.all_input_nodes
        }
        output_specs = []
        for spec in small.graph_signature.output_specs:
            made = copy.copy(spec)
            if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
                made.arg = TensorArgument(renamed[spec.arg.name])
            output_specs.append(made)
        signature = ExportGraphSignature(list(small.graph_signature.input_specs), output_specs)
        # the program's module is made from the small one's attributes and the new graph;
        # the copies read no attribute the small program lacks (module docstring), and
        # a module made here first would be compiled to Python twice (0.7 s at 96 layers)
        return torch.export.ExportedProgram(
            root=small.graph_module,
            graph=self.graph,
            graph_signature=signature,
            state_dict=small.state_dict,
            range_constraints=small.range_constraints,
            module_call_graph=small.module_call_graph,
            example_inputs=small.example_inputs,
            constants=small.constants,
            verifiers=small.verifiers,
        )
