"""Compute time of one op: the roofline model, dtype-aware.

An op that does ``F`` FLOPs and moves ``M`` bytes to and from device memory takes

    t = max(F / (peak[dtype] * e_c),  M / (mem_bw * e_m))

where ``e_c``, ``e_m`` are the preset's achievable fractions (Williams, Waterman & Patterson,
"Roofline: an insightful visual performance model", CACM 2009). An op whose arithmetic
intensity ``F / M`` is below ``peak / mem_bw`` (the ridge point: ~295 FLOP/byte for bf16 on
an H100) is memory-bound. Ops with no FLOPs (views, copies, integer ops) are memory-bound.

Backward (``backward_flops``): a matmul ``Y = X W`` needs ``dX = dY W^T`` and ``dW = X^T dY``,
two matmuls of the forward's size, so twice the forward FLOPs (Narayanan et al. 2021, Sec.
5.1: "the backward pass requires double the number of FLOPs"). Other ops: about one forward's
FLOPs. Backward moves about twice the forward's bytes (it reads the output gradient and the
saved inputs, and writes the input gradients): ``backward_bytes``.

Dtypes without a peak of their own fall back (``peak_flops``): float16 <-> bfloat16,
tfloat32 -> float32, float8 -> bfloat16, float64 -> float32 / 2 (datacenter GPUs run fp64 at
half the fp32 rate or better; consumer parts far slower, so give float64 where it matters);
integer and bool ops have no floating-point peak and are costed as memory-bound.

>>> from autopar_cost_model.hardware import load_preset
>>> preset = load_preset("h100-sxm")
>>> seconds = op_time(2 * 8192**3, 3 * 2 * 8192**2, "bfloat16", preset)  # compute-bound
>>> round(seconds * 1e3, 2)                                  # 1.1 PFLOP at 0.75 x 989 TFLOP/s
1.48
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from autopar_cost_model.hardware import DevicePreset, read_curve

if TYPE_CHECKING:
    import torch

OpKind = Literal["matmul", "other"]

_FALLBACKS: dict[str, tuple[tuple[str, float], ...]] = {
    "float64": (("float32", 0.5),),
    "tfloat32": (("float32", 1.0),),
    "float16": (("bfloat16", 1.0), ("float32", 1.0)),
    "bfloat16": (("float16", 1.0), ("float32", 1.0)),
    "float8": (("bfloat16", 1.0), ("float16", 1.0), ("float32", 1.0)),
}

_ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "tf32": "tfloat32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8",
}


def dtype_key(dtype: str | torch.dtype) -> str:
    """The ``peak_flops`` key for a dtype: ``torch.bfloat16``, ``"bf16"`` -> ``"bfloat16"``.

    Every float8 format (``float8_e4m3fn``, ``float8_e5m2``, ...) maps to ``"float8"``;
    a dtype that is not floating point keeps its name (and has no peak).
    """
    name = str(dtype).removeprefix("torch.").lower()
    if name.startswith("float8"):
        return "float8"
    return _ALIASES.get(name, name)


def peak_flops(preset: DevicePreset, dtype: str | torch.dtype) -> float | None:
    """Peak FLOP/s for ``dtype`` with the fallbacks of the module docstring; None if none."""
    key = dtype_key(dtype)
    if key in preset.peak_flops:
        return preset.peak_flops[key]
    for other, scale in _FALLBACKS.get(key, ()):
        if other in preset.peak_flops:
            return preset.peak_flops[other] * scale
    return None


def op_time(
    flops: float,
    bytes_moved: float,
    dtype: str | torch.dtype,
    preset: DevicePreset,
    family: str = "",
    call_flops: float | None = None,
) -> float:
    """Roofline time in seconds: ``max(flops / achievable peak, bytes / achievable bandwidth)``,
    times ``preset.in_step`` (ops run slower inside a step than alone, where they were measured).

    The achievable peak is the measured rate of the op's ``family`` (``matmul``,
    ``attention``) at ``call_flops`` (FLOPs of one forward call; default ``flops``) where the
    preset has one (``DevicePreset.op_rates``), else the peak times the compute efficiency.

    >>> from autopar_cost_model.hardware import load_preset
    >>> cpu = load_preset("cpu")
    >>> op_time(0, 8e6, "float32", cpu) == 8e6 / (20e9 * 0.8)      # no FLOPs: memory-bound
    True
    """
    memory_s = bytes_moved / (preset.memory_bandwidth * preset.efficiency.memory)
    rate = achieved_flops(preset, dtype, family, flops if call_flops is None else call_flops)
    if flops <= 0 or rate is None:
        return preset.in_step * memory_s
    return preset.in_step * max(flops / rate, memory_s)


def achieved_flops(
    preset: DevicePreset, dtype: str | torch.dtype, family: str, call_flops: float
) -> float | None:
    """FLOP/s an op of ``family`` doing ``call_flops`` per call reaches in ``dtype``: the
    preset's measured curve (``op_rates``), else ``peak_flops`` times the compute
    efficiency (None: no floating-point peak)."""
    curve = preset.op_rates.get(family, {}).get(dtype_key(dtype))
    if curve:
        return read_curve(tuple((float(f), float(r)) for f, r in curve), call_flops)
    peak = peak_flops(preset, dtype)
    return None if peak is None else peak * preset.efficiency.compute


def is_compute_bound(
    flops: float, bytes_moved: float, dtype: str | torch.dtype, preset: DevicePreset
) -> bool:
    """Whether the FLOP term of ``op_time`` is the larger one (intensity above the ridge)."""
    peak = peak_flops(preset, dtype)
    if flops <= 0 or peak is None:
        return False
    compute_s = flops / (peak * preset.efficiency.compute)
    return compute_s > bytes_moved / (preset.memory_bandwidth * preset.efficiency.memory)


def matmul_flops(m: int, k: int, n: int, batch: int = 1) -> int:
    """FLOPs of ``batch`` products of an (m, k) and a (k, n) matrix: ``2 m k n`` each."""
    return 2 * batch * m * k * n


def backward_flops(forward_flops: float, kind: OpKind = "matmul") -> float:
    """Backward FLOPs: ``2 x`` forward for a matmul (dX and dW), ``1 x`` for other ops."""
    return 2.0 * forward_flops if kind == "matmul" else float(forward_flops)


def backward_bytes(forward_bytes: float) -> float:
    """Backward memory traffic: ``2 x`` forward (read dY and saved inputs, write dX, dW)."""
    return 2.0 * forward_bytes


def backward_time(
    flops: float,
    bytes_moved: float,
    dtype: str | torch.dtype,
    preset: DevicePreset,
    kind: OpKind = "matmul",
) -> float:
    """Roofline time of the backward of an op whose forward does ``flops`` and ``bytes_moved``."""
    return op_time(backward_flops(flops, kind), backward_bytes(bytes_moved), dtype, preset)
