"""How a compiled model runs in the precision the plan was made for.

==============  ======================  =====================  ==========================
precision       parameters (optimizer)  forward compute        how
==============  ======================  =====================  ==========================
fp32            fp32                    fp32                   as the user's model
bf16_mixed      fp32 (master weights)   bf16 where autocast    ``torch.autocast(bf16)``
fp16_mixed      fp32 (master weights)   fp16 where autocast    ``torch.autocast(fp16)``
bf16            bf16                    bf16                   local shards cast to bf16
==============  ======================  =====================  ==========================

Mixed precision is ``torch.autocast`` around the rank's program: autocast works on the ATen
ops the lowered graph calls, so the compiled model computes what the single-device model
computes under the same autocast, and parameters, gradients and optimizer state stay fp32.
With fp16, loss scaling is the user's, as on one device (``torch.amp.GradScaler``); note
that a rank's inf/NaN check sees only its shards, so with sharded parameters the ranks'
decisions to skip a step can differ: prefer bf16.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from autopar_plans.errors import UsageError


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPrecision:
    """One row of the table above."""

    name: str
    """The plan's precision name."""
    compute: torch.dtype | None = None
    """The dtype autocast runs the forward in; None: no autocast."""
    params: torch.dtype | None = None
    """The dtype floating-point parameters and buffers are stored in; None: as given."""

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[object]:
        """The context the rank's program runs in."""
        if self.compute is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute)


PRECISIONS = {
    "fp32": RunPrecision(name="fp32"),
    "bf16_mixed": RunPrecision(name="bf16_mixed", compute=torch.bfloat16),
    "fp16_mixed": RunPrecision(name="fp16_mixed", compute=torch.float16),
    "bf16": RunPrecision(name="bf16", params=torch.bfloat16),
}


def check_precision(name: str) -> RunPrecision:
    """The policy called ``name``; ``UsageError`` naming the choices otherwise."""
    policy = PRECISIONS.get(name)
    if policy is None:
        raise UsageError(f"unknown precision {name!r}; one of {', '.join(PRECISIONS)}")
    return policy


def run_precision(name: str, device_type: str) -> RunPrecision:
    """The policy called ``name``, checked to work on ``device_type``.

    torch disables an autocast it cannot run (with a warning) rather than failing; here
    that is an error, since the user asked for the precision by name.
    """
    policy = check_precision(name)
    if policy.compute is None:
        return policy
    dtype = policy.compute
    problem = None
    if not torch.amp.is_autocast_available(device_type):
        problem = f"torch has no autocast for {device_type!r}"
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with torch.autocast(device_type, dtype=dtype):
                    works = (
                        torch.is_autocast_enabled(device_type)
                        and torch.get_autocast_dtype(device_type) == dtype
                    )
            except RuntimeError as error:  # CUDA without bf16 says so this way
                works, problem = False, str(error)
        if not works:
            problem = problem or f"autocast on {device_type!r} does not support {dtype}"
    if problem is not None:
        raise UsageError(
            f"precision {name!r} is not supported here: {problem}; plan with "
            "precision='fp32' or one this device supports"
        )
    return policy
