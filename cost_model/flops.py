"""FLOP counting as the cost model counts it: ``torch.utils.flop_counter`` with the CPU's
flash-attention kernels counted as the CUDA ones are (torch's registry has no formula for
``_scaled_dot_product_flash_attention_for_cpu``, which CPU runs and fake CPU tensors take,
so attention would count as no FLOPs). ``autopar_passes.probe`` counts the model's ops with it and
``autopar_cost_model.calibrate`` the ops it times, so measured rates and counted FLOPs agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter

aten = torch.ops.aten


def _already_shaped(formula: Callable[..., int]) -> Callable[..., int]:
    """Registry formulas already take tensors; tell FlopCounterMode not to wrap them again."""

    def call(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    call._get_raw = True  # type: ignore[attr-defined]
    return call


def cpu_flash_flop_mapping() -> dict[Any, Callable[..., int]]:
    registry = flop_counter.flop_registry
    mapping: dict[Any, Callable[..., int]] = {}
    forward = registry.get(aten._scaled_dot_product_flash_attention)
    backward = registry.get(aten._scaled_dot_product_flash_attention_backward)
    if forward is not None and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _already_shaped(forward)
    if backward is not None and hasattr(
        aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    ):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _already_shaped(
            backward
        )
    return mapping
