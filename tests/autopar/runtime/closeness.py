"""How close compiled fp32 training must come to single-device training.

Sharding reorders reductions: a matmul's inner sum becomes local partial sums and an
all-reduce, a data-parallel gradient a sum of per-rank sums. Two fp32 sums of the same n terms
taken in different orders differ by up to about n·u·Σ|x| (u = 2**-24, half an ulp at 1.0),
typically √n·u·|x|, and that error then flows through the rest of the step and through Adam.
Its size depends on the computation (how long the sums, how many steps), not on a fixed
relative tolerance, so each tensor's allowance is measured, not guessed:

- the same single-device run is repeated in float64, which holds the exact values to far
  better than fp32 precision;
- the single-device fp32 run's largest distance from it is that tensor's fp32 roundoff
  (``noise``), the error of one ordering of the same sums;
- the compiled run, whose sums are as long but in another order, must be as close to float64
  as ``NOISE_FACTOR`` times that, plus ``FLOOR_ULPS`` ulps of the tensor's largest value for a
  tensor whose single-device roundoff happens to be (near) zero.

Two orderings' errors are two samples of one distribution, and the maximum over a tensor's
elements varies between samples by a small factor, which ``NOISE_FACTOR`` covers: over the
equivalence, ZeRO, pipeline and MoE matrices (2,755 comparisons, torch 2.13.0 on CPU) the
compiled run's distance from float64 over the single device's had median 1.0 and maximum
4.9 for a tensor (a 64-element bias, whose maximum is over few elements), 8.7 for one
two-step loss sequence (which the ulp floor covers). A sharding bug (a missing reduction, a
wrong slice, a stale gradient) is off by a fraction of the value itself, orders of magnitude
above either term.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

NOISE_FACTOR = 8.0
FLOOR_ULPS = 4.0
U32 = 2.0**-24


def allowed_error(single: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest distance from ``exact`` that a reordering of ``single``'s sums may reach."""
    exact = exact.double()
    noise = float((single.double() - exact).abs().max()) if exact.numel() else 0.0
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    return NOISE_FACTOR * noise + FLOOR_ULPS * U32 * scale


def assert_trains_alike(
    got: torch.Tensor | Sequence[float],
    single: torch.Tensor | Sequence[float],
    exact: torch.Tensor | Sequence[float],
    what: str,
) -> None:
    """``got`` (compiled, fp32) is within the fp32 roundoff of ``single`` (single device,
    fp32) from ``exact`` (single device, float64); the message gives every number."""
    got, single, exact = (torch.as_tensor(t, dtype=torch.float64) for t in (got, single, exact))
    if got.shape != exact.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(exact.shape)}")
    allowed = allowed_error(single, exact)
    error = (got - exact).abs()
    worst = int(error.argmax()) if error.numel() else 0
    if error.numel() and float(error.flatten()[worst]) > allowed:
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape))
        noise = float((single - exact).abs().max())
        raise AssertionError(
            f"{what}: compiled is {float(error.flatten()[worst]):.3g} from float64 at {index} "
            f"(compiled {float(got.flatten()[worst]):.9g}, single-device fp32 "
            f"{float(single.flatten()[worst]):.9g}, float64 {float(exact.flatten()[worst]):.9g}); "
            f"allowed {allowed:.3g} = {NOISE_FACTOR:g} x single-device fp32 roundoff {noise:.3g} "
            f"+ {FLOOR_ULPS:g} ulp x max |value| {float(exact.abs().max()):.3g}"
        )


def in_float64(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """The same case in float64, for the exact run: a copy of the model, its float inputs
    and target cast."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.double() if t.is_floating_point() else t

    return copy.deepcopy(model).double(), tuple(cast(t) for t in inputs), cast(target)


def assert_same_training(result: dict[str, Any]) -> None:
    """One multi-rank ``compare`` result (``ref_*``: single device in fp32, ``exact_*``: in
    float64): losses, first gradients, final parameters and buffers each within the fp32
    roundoff of single-device training."""
    case = result["case"]
    assert_trains_alike(
        result["losses"], result["ref_losses"], result["exact_losses"], f"{case}: losses"
    )
    for kind in ("grads", "params", "buffers"):
        for name, ref in result.get(f"ref_{kind}", {}).items():
            assert_trains_alike(
                result[kind][name], ref, result[f"exact_{kind}"][name], f"{case}: {kind} of {name}"
            )
