"""Module paths and repeated layers, read from ``nn_module_stack``.

Transformers repeat one block ``n`` times in a ``ModuleList`` (``layers.0``, ``layers.1``,
... or ``model.layers.0`` in Hugging Face models). The *layer container* is the module path
whose numbered children hold the most distinct indices; a node under ``<container>.<i>`` is
in layer ``i``. Nodes outside it (embeddings, the final norm, the head) have no layer.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

_INDEXED = re.compile(r"\[(\d+)\]")
_SELF_PREFIX = re.compile(r"^L\['self'\]\.?")


def module_path(node: torch.fx.Node) -> str:
    """The innermost module path of the code that produced ``node`` ("" for the root)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _type = list(stack.values())[-1]
    return normalise_path(path)


def normalise_path(path: str) -> str:
    """``L['self'].model.layers[0].mlp`` -> ``model.layers.0.mlp``."""
    path = _SELF_PREFIX.sub("", path)
    path = _INDEXED.sub(r".\1", path)
    return path.strip(".")


@dataclass(frozen=True, slots=True)
class LayerContainer:
    """Where the repeated layers live: ``path`` (``"layers"``) and how many there are."""

    path: str
    count: int

    def index_of(self, module: str) -> int | None:
        prefix = f"{self.path}." if self.path else ""
        if not module.startswith(prefix):
            return None
        head = module[len(prefix) :].split(".", 1)[0]
        return int(head) if head.isdigit() else None


def find_layer_container(module_paths: Iterable[str]) -> LayerContainer | None:
    """The container path with the most numbered children, or None if nothing repeats."""
    indices: dict[str, set[int]] = defaultdict(set)
    for path in module_paths:
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                indices[".".join(parts[:i])].add(int(part))
    if not indices:
        return None
    best = max(indices, key=lambda p: (len(indices[p]), -p.count(".")))
    return LayerContainer(path=best, count=max(indices[best]) + 1)
