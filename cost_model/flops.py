"""FLOP counting as the cost model counts it: ``torch.utils.flop_counter`` with the CPU's
flash-attention kernels counted as the CUDA ones are (torch's registry has no formula for
``_scaled_dot_product_flash_attention_for_cpu``, which CPU runs and fake CPU tensors take,
so attention would count as no FLOPs), and the grouped matmuls of mixture-of-experts layers
(``aten._grouped_mm``, transformers' ``grouped_mm_fallback``), which it has no formula for
either. ``autopar_passes.probe`` counts the model's ops with it and
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


def grouped_mm_flops(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    """A grouped matmul: rows ``[S, d_in]`` against experts ``[E, d_in, d_out]``, each row
    times one expert's matrix, ``2 S d_in d_out``; or ``[E, M, K] @ [E, K, N]``, every
    group whole, ``2 E M K N``."""
    if len(x_shape) == 3:
        return 2 * x_shape[0] * x_shape[1] * x_shape[2] * w_shape[-1]
    return 2 * x_shape[0] * x_shape[1] * w_shape[-1]


def grouped_mm_backward_flops(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    """The gradients of the rows and of the experts: twice the forward."""
    return 2 * grouped_mm_flops(x_shape, w_shape)


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
    if hasattr(aten, "_grouped_mm"):
        mapping[aten._grouped_mm] = grouped_mm_flops
    library = torch.ops.transformers  # registered when transformers' MoE code is imported
    if hasattr(library, "grouped_mm_fallback"):
        mapping[library.grouped_mm_fallback] = grouped_mm_flops
    if hasattr(library, "grouped_mm_fallback_backward"):
        mapping[library.grouped_mm_fallback_backward] = grouped_mm_backward_flops
    return mapping
