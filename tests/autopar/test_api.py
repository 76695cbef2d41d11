"""``autopar.compile``: what it keeps and what it lets go of."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.testing.ranks import run_ranks
from autopar_examples.models import build

pytestmark = pytest.mark.multirank


def _model_outlives_compile(rank: int, world_size: int) -> dict[str, bool]:
    model, (tokens,) = build("gpt-tiny")
    given = copy.deepcopy(model)
    weight = weakref.ref(given.wte.weight)
    # The cycle collector would otherwise run whenever enough objects were allocated: off,
    # what stays alive is what is referenced, or in a cycle that compile left behind.
    gc.disable()
    try:
        compiled = autopar.compile(
            given, autopar.Mesh((1,), ("x",)), example_inputs=(tokens,), precision="bf16_mixed"
        )
        del given
        freed = weight() is None
    finally:
        gc.enable()
    return {"freed": freed, "compiled_has_weights": len(list(compiled.parameters())) > 0}


def test_compile_lets_go_of_the_model_it_was_given():
    """The compiled module holds its own copies of the weights; once the caller drops the
    model, its weights are freed at once, not at some later cycle collection (on an H200,
    a lingering 1.3B-parameter model was a whole fp32 copy of the weights, 5.3 GB, on top
    of the compiled step's peak)."""
    result = run_ranks(_model_outlives_compile, 1)[0]
    assert result["compiled_has_weights"]
    assert result["freed"]


class _ConvNet(nn.Module):
    """A pixel shuffle, which has no sharding rule: its plan says so in a warning."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.pixel_shuffle(self.conv(x), 2).mean((2, 3)))


def _compile_warnings(rank: int, world_size: int) -> list[tuple[str, str]]:
    x = torch.randn(4, 3, 8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.compile(_ConvNet(), autopar.Mesh((world_size,), ("x",)), example_inputs=(x,))
    return [(str(w.message), w.filename) for w in caught if w.category is autopar.PlanWarning]


def test_a_plans_warnings_are_pythons_warnings_at_the_callers_line():
    """Each of ``plan.warnings`` goes through ``warnings.warn`` as a ``PlanWarning``, so
    that a warnings filter (or ``pytest -W error``) sees it, attributed to the user's own
    call of ``plan`` or ``compile``."""
    x = torch.randn(4, 3, 8, 8)
    unknown = "no sharding rule for aten.pixel_shuffle"
    with pytest.warns(autopar.PlanWarning, match=unknown) as planned:
        plan = autopar.plan(_ConvNet(), autopar.Mesh((2,), ("dp",), device="cpu"), (x,))
    mine = [w for w in planned if w.category is autopar.PlanWarning]
    assert [str(w.message) for w in mine] == list(plan.warnings)
    assert {w.filename for w in mine} == {__file__}
    for found in run_ranks(_compile_warnings, 2):
        assert [message for message, _ in found] == list(plan.warnings)
        assert {filename for _, filename in found} == {__file__}


def test_progress_is_told_the_trace_and_each_candidate():
    """What ``autopar plan`` shows on a terminal while it plans: the trace, then each stage
    count's solve, with the best step time found so far once one fits."""
    model, inputs = build("gpt-tiny")
    told: list[str] = []
    autopar.plan(
        model, autopar.Mesh((2, 2), device="h100-sxm"), inputs, global_batch=8, progress=told.append
    )
    assert told[0] == "tracing the model"
    assert told[1].startswith("traced ") and " nodes in " in told[1]
    assert told[2] == "no pipeline (1 of 2): fastest layouts"  # gpt-tiny's 2 layers: 1 or 2
    assert told[3].startswith("2 stages (2 of 2): fastest layouts; best ")
    assert told[3].endswith(" a step")


def test_microbatch_inputs_cut_the_example_or_repeat_it_for_a_larger_microbatch():
    """What a plan's program is traced on: the first ``size`` rows of every batch-major
    input, or the example repeated where the search planned microbatches larger than it
    (one sequence per node from a preset's one); other inputs pass as they are."""
    from autopar.api import microbatch_inputs
    from autopar_plans import UsageError

    tokens = torch.arange(12).reshape(4, 3)
    scale = torch.tensor([2.0])
    (cut, same) = microbatch_inputs((tokens, scale), 4, 2)
    assert torch.equal(cut, tokens[:2]) and same is scale
    (grown,) = microbatch_inputs((tokens[:1],), 1, 3)
    assert torch.equal(grown, tokens[:1].repeat(3, 1))
    kwargs = microbatch_inputs({"idx": tokens}, 4, 8)
    assert torch.equal(kwargs["idx"], torch.cat([tokens, tokens]))
    with pytest.raises(UsageError, match="a microbatch of 6 from example inputs of batch 4"):
        microbatch_inputs((tokens,), 4, 6)
