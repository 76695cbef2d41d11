"""Matmul-like strategies from one einsum algebra (as DTensor's ``_einsum_strategy``).

An op is described by its operands' subscripts and the output's: ``linear`` is
``"bsh,fh->bsf"`` plus an *additive* bias ``"f"``. For each mesh axis, one of:

- replicate: every operand and the output replicated, the work repeated;
- shard a letter that the output keeps (a batch, M or N dim): operands holding it are split
  on it, the others replicated, the output split on it;
- shard a contracted letter (K): operands holding it are split on it, the output is
  ``Partial`` (each device sums over its slice of K); an additive operand must arrive
  ``Partial`` too, so that it is added once;
- take one multiplicative operand ``Partial`` with the others replicated: a matmul is linear
  in each operand, so the output is ``Partial`` too (this lets a reduction wait).

>>> ops = [("bsh", "mul"), ("fh", "mul"), ("f", "add")]
>>> len(einsum_strategies(ops, "bsf", call, (2, 2)))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.types import OpCall, Strategy
from autopar_plans.placement import PARTIAL, REPLICATE, Placement, Shard

Operand = tuple[str, Literal["mul", "add"]]


def einsum_choices(operands: Sequence[Operand], output: str) -> list[AxisChoice]:
    """The choices one mesh axis has for an einsum (see the module docstring)."""
    choices = [replicate_choice(len(operands), 1)]
    letters = dict.fromkeys(c for subs, _ in operands for c in subs)
    for letter in letters:
        kept = letter in output

        def placement(subs: str, kind: str, letter: str = letter, kept: bool = kept) -> Placement:
            if letter in subs:
                return Shard(subs.index(letter))
            if not kept and kind == "add":
                return PARTIAL
            return REPLICATE

        inputs = tuple(placement(subs, kind) for subs, kind in operands)
        out = Shard(output.index(letter)) if kept else PARTIAL
        choices.append(AxisChoice(inputs, (out,), tag=f"shard:{letter}"))
    for k, (_, kind) in enumerate(operands):
        if kind != "mul":
            continue
        inputs = tuple(
            PARTIAL if i == k or other == "add" else REPLICATE
            for i, (_, other) in enumerate(operands)
        )
        choices.append(AxisChoice(inputs, (PARTIAL,), splits_work=False, tag=f"partial:{k}"))
    return choices


def einsum_strategies(
    operands: Sequence[Operand], output: str, call: OpCall, mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """Strategies of an einsum-like op whose tensor inputs are ``operands``, in order."""
    if len(operands) != len(call.inputs):
        raise ValueError(f"{call.target}: {len(operands)} operands for {len(call.inputs)} inputs")
    return combine(einsum_choices(operands, output), call, mesh_shape)


def batch_letters(ndim: int, reserved: str) -> str:
    """``ndim`` letters not in ``reserved``, for leading batch dims."""
    pool = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in reserved]
    return "".join(pool[:ndim])
