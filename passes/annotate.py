"""The annotate pass: write ``node.meta["autopar"]`` (see ``autopar_passes.annotation``) on every
node.

Reads: the exported graph (``node.meta["val"]``, ``nn_module_stack``) and its signature
(which placeholders are parameters, buffers, user inputs). Writes: one ``NodeAnnotation``
per node. Each op is probed once per distinct signature (``autopar_passes.probe``).

Saved-for-backward bytes are attributed to the node that *owns* the storage: a view's
storage belongs to its base, so a tensor that several consumers save, directly or through
views, is counted once. Parameters and inputs are never counted as activations.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from autopar_passes.annotation import META_KEY, NodeAnnotation, NodeKind, TensorInfo, dtype_name
from autopar_passes.layers import LayerContainer, module_path
from autopar_passes.probe import OpProbe, OpProber


def _tensor_infos(value: object) -> tuple[TensorInfo, ...]:
    if isinstance(value, torch.Tensor):
        return (TensorInfo(tuple(int(s) for s in value.shape), dtype_name(value.dtype)),)
    if isinstance(value, list | tuple):
        return tuple(info for item in value for info in _tensor_infos(item))
    return ()


def storage_id(value: object) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.untyped_storage()._cdata
    return None


def _flat_tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor-valued input nodes in the order ``OpProber`` flattens them (args, then kwargs)."""
    found: list[torch.fx.Node] = []

    def visit(value: object) -> None:
        if isinstance(value, torch.fx.Node):
            if isinstance(value.meta.get("val"), torch.Tensor):
                found.append(value)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    visit(node.args)
    visit(node.kwargs)
    return found


def annotate_graph(
    graph: torch.fx.Graph,
    placeholder_kinds: Mapping[str, tuple[NodeKind, str | None]],
    layers: LayerContainer | None,
) -> list[str]:
    """Annotate every node of ``graph``; returns warnings (ops whose cost is unknown).

    ``placeholder_kinds`` maps a placeholder's name to its kind and, for parameters and
    buffers, its qualified name.
    """
    prober = OpProber()
    requires_grad: dict[torch.fx.Node, bool] = {}
    owner_of_storage: dict[int, torch.fx.Node] = {}
    saved_owners: set[torch.fx.Node] = set()
    internal_saved: dict[torch.fx.Node, int] = {}
    probes: dict[torch.fx.Node, OpProbe] = {}
    warnings: list[str] = []
    fields: dict[torch.fx.Node, dict[str, object]] = {}

    def needs_grad(node: torch.fx.Node) -> bool:
        return requires_grad.get(node, False)

    for node in graph.nodes:
        val = node.meta.get("val")
        outputs = _tensor_infos(val)
        module = module_path(node)
        entry: dict[str, object] = {
            "outputs": outputs,
            "module": module,
            "layer": layers.index_of(module) if layers else None,
        }
        storage = storage_id(val)
        if node.op == "placeholder":
            kind, qualified = placeholder_kinds.get(node.name, ("input", None))
            entry.update(kind=kind, op=kind, param=qualified if kind == "param" else None)
            if kind == "param" and isinstance(val, torch.Tensor):
                requires_grad[node] = val.is_floating_point()
            if storage is not None:
                owner_of_storage.setdefault(storage, node)
            entry["module"] = qualified.rsplit(".", 1)[0] if qualified and "." in qualified else ""
            if layers and qualified:
                entry["layer"] = layers.index_of(qualified)
        elif node.op == "output":
            entry.update(kind="output", op="output", outputs=())
        elif node.op == "get_attr":
            entry.update(kind="constant", op="get_attr")
        elif node.target is operator.getitem:
            parent = node.args[0]
            assert isinstance(parent, torch.fx.Node)
            requires_grad[node] = (
                needs_grad(parent)
                and bool(outputs)
                and (outputs[0].dtype.startswith(("float", "bfloat", "complex")))
            )
            entry.update(kind="view", op="getitem")
            _attach_to_owner(node, storage, owner_of_storage, entry)
        else:
            probe = prober.probe(node, needs_grad)
            probes[node] = probe
            if not probe.ok:
                warnings.append(f"{node.name} ({node.target}): cost unknown, {probe.error}")
            requires_grad[node] = any(probe.output_requires_grad)
            inputs = _flat_tensor_args(node)
            is_view = bool(probe.input_aliases) and all(a is not None for a in probe.input_aliases)
            read = sum(_nbytes(n) for n in {id(n): n for n in inputs}.values())
            written = sum(info.nbytes for info in outputs)
            entry.update(
                kind="view" if is_view else "op",
                op=str(node.target),
                fwd_flops=probe.fwd_flops,
                bwd_flops=probe.bwd_flops,
                bytes_read=0 if is_view else read,
                bytes_written=0 if is_view else written,
            )
            _attach_to_owner(node, storage, owner_of_storage, entry)
            for position in probe.saved_inputs:
                if position < len(inputs):
                    saved_owners.add(_owner(inputs[position], owner_of_storage))
            if probe.saved_outputs:
                saved_owners.add(_owner(node, owner_of_storage))
            internal_saved[node] = probe.internal_saved_bytes
            entry["internal_saved_bytes"] = probe.internal_saved_bytes
            entry["saved_inputs"] = tuple(sorted(probe.saved_inputs))
        entry["requires_grad"] = requires_grad.get(node, False)
        fields[node] = entry

    for node, entry in fields.items():
        saved = internal_saved.get(node, 0)
        if node in saved_owners and entry["kind"] not in ("param", "buffer", "input", "constant"):
            saved += _storage_bytes(node)
        entry["saved_bytes"] = saved
        node.meta[META_KEY] = NodeAnnotation(**entry)  # type: ignore[arg-type]
    return warnings


def _attach_to_owner(
    node: torch.fx.Node,
    storage: int | None,
    owner_of_storage: dict[int, torch.fx.Node],
    entry: dict[str, object],
) -> None:
    """Record which node owns this output's storage; a view points at that owner."""
    if storage is None:
        return
    owner = owner_of_storage.setdefault(storage, node)
    if owner is not node:
        entry["alias_of"] = owner.name


def _owner(node: torch.fx.Node, owner_of_storage: dict[int, torch.fx.Node]) -> torch.fx.Node:
    storage = storage_id(node.meta.get("val"))
    return owner_of_storage.get(storage, node) if storage is not None else node


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _storage_bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.untyped_storage().nbytes()
    if isinstance(val, list | tuple):
        return sum(v.untyped_storage().nbytes() for v in val if isinstance(v, torch.Tensor))
    return 0
