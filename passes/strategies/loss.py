"""Sharding rules: loss family. (Being written.)"""

from __future__ import annotations

from passes.strategies.types import LocalKind, Rule

RULES: dict[object, Rule] = {}
LOCALS: dict[str, LocalKind] = {}
