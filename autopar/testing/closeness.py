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
