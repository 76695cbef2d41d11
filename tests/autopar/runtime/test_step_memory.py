"""A compiled step on one device holds no more memory than the eager step.

The GPU target compares eager and ``autopar.compile`` (mesh of 1) in bf16 mixed precision;
on CPU the same comparison counts live tensor storage (``live_bytes.LiveBytes``): the
weights, gradients and AdamW state, and the peak of a step, after a first step has made
the optimizer's state.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.testing.ranks import run_ranks
from autopar_examples.models import build
from tests.autopar.runtime.live_bytes import LiveBytes

pytestmark = pytest.mark.multirank


def _step_bytes(model: nn.Module, tokens: torch.Tensor) -> tuple[int, int]:
    """(peak, resident after) bytes of the second of two bf16 AdamW steps."""
    targets = torch.roll(tokens, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    live = LiveBytes()
    for param in model.parameters():
        live.track(param)
    with live:
        for step in range(2):
            if step == 1:
                live.peak = live.current  # the steady state: the optimizer's state made
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            del logits, loss
    return live.peak, live.current


def _eager_and_compiled(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, (tokens,) = build("gpt-demo", n_layer=2, d_model=128, batch_size=4)
    eager = _step_bytes(copy.deepcopy(model), tokens)
    compiled = autopar.compile(
        copy.deepcopy(model),
        autopar.Mesh((1,), ("x",)),
        example_inputs=(tokens,),
        precision="bf16_mixed",
    )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"eager": eager, "compiled": _step_bytes(compiled, tokens), "weights": weights}


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    return run_ranks(_eager_and_compiled, 1)[0]


def test_the_compiled_step_peaks_no_higher_than_eager(measured: dict[str, Any]) -> None:
    (eager_peak, _), (compiled_peak, _) = measured["eager"], measured["compiled"]
    assert compiled_peak <= eager_peak


def test_the_compiled_module_holds_what_eager_holds(measured: dict[str, Any]) -> None:
    """Weights, gradients and AdamW's two moments: four copies of the fp32 weights."""
    (_, eager_resident), (_, compiled_resident) = measured["eager"], measured["compiled"]
    assert compiled_resident == eager_resident
    assert eager_resident == pytest.approx(4 * measured["weights"], rel=0.01)
