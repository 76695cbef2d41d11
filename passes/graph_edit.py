"""Small helpers for passes that add nodes to an exported graph before annotation."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.fx import Node
from torch.fx.passes.shape_prop import _extract_tensor_metadata

COPIED_META = ("nn_module_stack", "stack_trace", "torch_fn")


def copy_meta(source: Node, new: Node) -> None:
    """Give ``new`` the module path and source line of the node it replaces."""
    for key in COPIED_META:
        if key in source.meta:
            new.meta[key] = source.meta[key]


def set_val(node: Node) -> None:
    """``meta["val"]`` (and ``tensor_meta``): run the op on its inputs' fake values."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    fake_mode = next((v.fake_mode for v in flat(args) if hasattr(v, "fake_mode")), None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        val = node.target(*args, **kwargs)  # type: ignore[operator]
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)


def flat(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [v for item in value for v in flat(item)]
    if isinstance(value, dict):
        return [v for item in value.values() for v in flat(item)]
    return [value]
