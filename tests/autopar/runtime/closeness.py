"""How close compiled fp32 training must come to single-device training: the allowance
(``autopar.testing.closeness``) applied to losses, gradients, parameters and buffers."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from autopar.testing.closeness import FLOOR_ULPS, NOISE_FACTOR, allowed_error


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
