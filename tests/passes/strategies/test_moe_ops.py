"""The transformers-5 expert ops: every strategy brute-forced against the op on one device
(the grouped matmul with uneven, empty and whole groups), and expert parallelism offered."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar_passes.strategies.moe import RULES, grouped_mm_rule
from autopar_passes.strategies.validate import check_rule, describe_failures

transformers = pytest.importorskip("transformers.integrations.moe")  # registers the op
GROUPED = torch.ops.transformers.grouped_mm_fallback.default
aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2)]


def r(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=generator)


def offsets(*counts: int) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0)


# 16 sorted rows over 4 experts: uneven groups, an empty one, one expert taking all
CASES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "grouped": (GROUPED, (r(16, 8), r(4, 8, 12, seed=1), offsets(3, 6, 0, 7))),
    "grouped-one-expert": (GROUPED, (r(16, 8), r(4, 8, 12, seed=1), offsets(0, 16, 0, 0))),
    "grouped-even": (GROUPED, (r(16, 8), r(4, 8, 12, seed=1), offsets(4, 4, 4, 4))),
    "histc": (aten.histc.default, (torch.tensor([0.0, 1, 1, 3, 2, 3, 3, 0]), 4, 0, 3)),
    "index_put": (
        aten.index_put.default,
        (r(8, 12), [torch.tensor([5, 0, 3])], r(3, 12, seed=1)),
    ),
}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_matches_the_op_on_one_device(case: str, mesh: tuple[int, ...]) -> None:
    target, args = CASES[case]
    rule = grouped_mm_rule if target is GROUPED else RULES[target]
    strategies, failures = check_rule(rule, target, args, mesh_shape=mesh)
    assert len(strategies) > 1
    assert not failures, describe_failures(failures)


def test_the_grouped_matmul_offers_expert_and_row_parallelism() -> None:
    target, args = CASES["grouped"]
    names = {s.name for s in check_rule(grouped_mm_rule, target, args, mesh_shape=(2,))[0]}
    assert "R,S(0),R->P" in names  # experts split: each device its experts' rows
    assert "S(0),R,R->S(0)" in names  # the sorted rows split, every expert everywhere
    assert "R,S(2),R->S(1)" in names  # the output features split
    assert not any(name.split(",")[2].startswith("S") for name in names)  # offs whole


def test_a_grouped_matmul_costs_what_its_rows_multiply() -> None:
    """Each row meets one expert's matrix: 2 S d_in d_out FLOPs forward, twice that
    backward (torch's counter has no formula for either op, so experts were free)."""
    from torch.utils.flop_counter import FlopCounterMode

    from autopar_cost_model.flops import cpu_flash_flop_mapping

    x, w, offs = CASES["grouped"][1]
    x, w = x.float().requires_grad_(), w.float().requires_grad_()
    with FlopCounterMode(display=False, custom_mapping=cpu_flash_flop_mapping()) as forward:
        out = GROUPED(x, w, offs)
    with FlopCounterMode(display=False, custom_mapping=cpu_flash_flop_mapping()) as backward:
        out.sum().backward()
    assert forward.get_total_flops() == 2 * 16 * 8 * 12
    assert backward.get_total_flops() == 2 * forward.get_total_flops()
