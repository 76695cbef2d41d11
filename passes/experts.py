"""Expert matmuls: where expert parallelism shows in a graph and in a plan.

Nothing in the solver knows about experts. A mixture-of-experts layer holds its experts'
weights stacked, one tensor with an expert dim (``w_gate`` of shape (E, d, f)), and runs
them as one batched matmul, ``egcd,edf->egcf``; the einsum rules let a mesh axis shard any
letter, and sharding ``e`` runs a slice of the experts on each device. This module only
*recognises* that afterwards, for the plan's summary (``Plan.parallelism.ep``) and for the
forced ``ep`` styles (``autopar.force``):

an **expert matmul** is an einsum (or a batched ``bmm``/``matmul``) with a parameter operand
one of whose dims is a batch dim of the product: its letter is in the other operand and in
the output. That dim is the **expert dim**. A grouped matmul (transformers 5's experts,
``autopar_passes.strategies.moe``) is one by what it is: its weight's dim 0 holds the
experts, and its rows (sorted by expert) have no expert dim (``tokens_dim`` 0: the rows).
The dispatch einsum ``gsec,gsd->egcd`` has the same shape of subscripts but no parameter
operand, so it is not one.

>>> expert_dims("egcd,edf->egcf", weight=1)
(0, 0)
>>> expert_dims("bsh,fh->bsf", weight=1) is None
True
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar_passes.strategies.graph import NodeChoices
from autopar_passes.strategies.moe import GROUPED_NAMES

BATCHED = {"aten.bmm.default", "aten.matmul.default"}


@dataclass(frozen=True, slots=True)
class ExpertMatmul:
    """Positions (in the op's tensor inputs) and expert dims of the weight and the tokens."""

    weight: int
    weight_dim: int
    tokens: int
    tokens_dim: int


def expert_dims(equation: str, weight: int) -> tuple[int, int] | None:
    """(expert dim of operand ``weight``, of the other operand) in a two-operand einsum
    ``equation``, or None when the weight has no batch letter."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "..." in equation:
        return None
    left, output = equation.split("->")
    operands = left.split(",")
    if len(operands) != 2:
        return None
    other = operands[1 - weight]
    for dim, letter in enumerate(operands[weight]):
        if letter in other and letter in output:
            return dim, other.index(letter)
    return None


def expert_matmul(choices: NodeChoices) -> ExpertMatmul | None:
    """The expert matmul ``choices`` stands for, or None (see the module docstring)."""
    call = choices.call
    if call is None or choices.kind != "op":
        return None
    target = str(call.target)
    if target in GROUPED_NAMES:  # grouped_mm(rows, weight [E, d_in, d_out], offs)
        return ExpertMatmul(weight=1, weight_dim=0, tokens=0, tokens_dim=0)
    if len(choices.params) != 2:
        return None
    for weight, name in enumerate(choices.params):
        if name is None:
            continue
        tokens = 1 - weight
        if target == "aten.einsum.default":
            dims = expert_dims(str(call.args[0]), weight)
            if dims is not None:
                return ExpertMatmul(weight, dims[0], tokens, dims[1])
        elif target in BATCHED and weight == 1:
            shapes = [info.shape for info in call.inputs]
            if len(shapes[0]) == len(shapes[1]) == 3 and shapes[0][0] == shapes[1][0] > 1:
                return ExpertMatmul(1, 0, 0, 0)  # (E, C, d) @ (E, d, f)
    return None
