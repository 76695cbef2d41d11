"""The rule table: every ATen op autopar can shard, one small function each, by family.

Each family module exports ``RULES`` (op -> rule) and may export ``LOCALS`` (special local
kinds its strategies use, see ``autopar_passes.strategies.localize``). This file only merges them;
a new op is one function in the right family file and one line in its ``RULES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from types import MappingProxyType

from autopar_passes.strategies import (
    attention,
    conv,
    embedding,
    inplace,
    loss,
    matmul,
    moe,
    norm,
    pointwise,
    pool,
    reduction,
    scatter,
    view,
)
from autopar_passes.strategies.types import LocalKind, Rule

FAMILIES = (
    matmul,
    conv,
    pool,
    pointwise,
    view,
    reduction,
    norm,
    attention,
    embedding,
    loss,
    scatter,
    moe,
    inplace,
)


@cache
def rules() -> Mapping[object, Rule]:
    """Op -> rule, over all families (read-only)."""
    merged: dict[object, Rule] = {}
    for family in FAMILIES:
        for op, rule in family.RULES.items():
            if op in merged:
                raise ValueError(f"{op} has rules in two families")
            merged[op] = rule
    return MappingProxyType(merged)


def rule_for(target: object) -> Rule | None:
    """The rule of ``target``: by the op itself, or by its name for a custom op a library
    registers (``transformers.grouped_mm_fallback``), which may come after the table."""
    found = rules().get(target)
    if found is None:
        for family in FAMILIES:
            found = getattr(family, "NAMED_RULES", {}).get(str(target))
            if found is not None:
                break
    return found


@cache
def local_kinds() -> Mapping[str, LocalKind]:
    """Special local kind name -> how a device runs it (read-only)."""
    merged: dict[str, LocalKind] = {}
    for family in FAMILIES:
        merged.update(getattr(family, "LOCALS", {}))
    return MappingProxyType(merged)
