"""Gradient compression: what a compressed gradient sum sends, call by call.

A scheme replaces the all-reduce of a bucket of gradients by collectives on a smaller
encoding, summing over each replicating mesh axis in turn (a sum over several axes is the
sum over each, one after the other, so every scheme composes with any number of axes).
``compressed_calls`` lists those calls for a bucket; the runtime
(``autopar.runtime.compression``) issues exactly them and the ledger records exactly them,
so a test can count one against the other.

==========  ===========================================  ==================================
scheme      per replicating axis (``n`` devices)         state per gradient value
==========  ===========================================  ==================================
bf16/fp16   all-reduce of the bucket in 16 bits          none
terngrad    all-reduce (max) of one fp32 scale a         none
            tensor; all-reduce of int8 levels (int32
            past 127 devices: see ``level_dtype``)
topk        all-gather of k fp32 values and k int32      error feedback (fp32); with
            indices per tensor (k = ceil(ratio numel))   momentum correction, velocity too
block_topk  all-gather of the kept blocks' values and    error feedback (fp32)
            one int32 index per block
powersgd    all-reduce of P [rows, r]; all-reduce of     error feedback (fp32) and Q
            Q [cols, r]; vectors all-reduced whole       [cols, r] (fp32)
==========  ===========================================  ==================================

Sources: DDP's ``bf16_compress_hook``; TernGrad (Wen et al. 2017, arXiv 1705.07878);
Deep Gradient Compression (Lin et al. 2018, arXiv 1712.01887); coarse-grained sparse
communication (Sun et al. 2019, arXiv 1902.06855); PowerSGD (Vogels et al. 2019, arXiv
1905.13727; torch's ``powerSGD_hook``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

Scheme = Literal["none", "bf16", "fp16", "terngrad", "topk", "block_topk", "powersgd"]
SCHEMES: tuple[str, ...] = ("none", "bf16", "fp16", "terngrad", "topk", "block_topk", "powersgd")


class GradCompression(BaseModel):
    """How gradients are compressed before they cross the replicating mesh axes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheme: Scheme = "none"
    ratio: float = Field(
        0.01, gt=0.0, le=1.0, description="topk, block_topk: the share of values sent."
    )
    block: int = Field(256, ge=1, description="block_topk: values per block.")
    rank: int = Field(4, ge=1, description="powersgd: the rank of the approximation.")
    momentum: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="topk: DGC's momentum correction (0: error feedback alone). With it, "
        "step the model with plain SGD: the momentum lives in the compressor.",
    )
    clip: float | None = Field(
        2.5,
        gt=0.0,
        description="terngrad: clip each gradient at clip x its standard deviation before "
        "ternarizing (the paper's c = 2.5); None: no clipping.",
    )
    seed: int = Field(0, description="terngrad: the seed of the stochastic rounding.")

    @property
    def active(self) -> bool:
        return self.scheme != "none"

    @property
    def cast_dtype(self) -> str | None:
        """The dtype a casting scheme sums in."""
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.scheme)

    @property
    def encodes(self) -> bool:
        """A scheme with its own encoding (not a plain cast)."""
        return self.scheme in ("terngrad", "topk", "block_topk", "powersgd")

    def compresses(self, shape: Sequence[int]) -> bool:
        """Whether a gradient of ``shape`` is encoded; PowerSGD sends a vector, or a matrix
        whose factors are no smaller than it, whole (as torch's ``powerSGD_hook``)."""
        if not self.encodes:
            return False
        if self.scheme == "powersgd":
            rows, cols = matrix_shape(shape)
            return len(shape) >= 2 and (rows + cols) * self.rank < rows * cols
        return math.prod(shape) > 0

    def kept(self, numel: int) -> int:
        """topk: values sent of a tensor of ``numel``; block_topk: blocks sent."""
        if self.scheme == "block_topk":
            return max(1, math.ceil(self.ratio * math.ceil(numel / self.block)))
        return max(1, math.ceil(self.ratio * numel))


class WireCall(NamedTuple):
    """One collective of a compressed sum: over the ``position``-th replicating axis."""

    kind: str
    position: int
    dtype: str
    nbytes: float
    what: str


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """A gradient as the matrix PowerSGD factors: its first dim by the rest."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def level_dtype(devices: int) -> str:
    """The integer dtype TernGrad sums its levels in over ``devices`` devices: the sum of
    levels in {-1, 0, 1} lies in [-devices, devices], so int8 holds it up to 127 devices.
    Past that, int32: neither gloo nor NCCL sums int16."""
    return "int8" if devices <= 127 else "int32"


def compressed_calls(
    scheme: GradCompression, shapes: Sequence[Sequence[int]], sizes: Sequence[int]
) -> list[WireCall]:
    """The collectives that sum a bucket of gradients of ``shapes`` (fp32, only those
    ``scheme.compresses``) over axes of ``sizes``, in the order the runtime issues them.
    Bytes are the plan's payloads (``autopar_plans.ledger``): an all-reduce's tensor, an
    all-gather's output."""
    calls: list[WireCall] = []
    numels = [math.prod(s) for s in shapes]
    gathered = 1  # devices whose encodings an all-gather has collected so far
    if scheme.scheme == "terngrad":
        for position, _ in enumerate(sizes):
            calls.append(WireCall("all_reduce", position, "float32", 4.0 * len(shapes), "scales"))
        dtype = level_dtype(math.prod(sizes))
        width = 1.0 if dtype == "int8" else 4.0
        for position, _ in enumerate(sizes):
            calls.append(WireCall("all_reduce", position, dtype, width * sum(numels), "levels"))
    elif scheme.scheme in ("topk", "block_topk"):
        if scheme.scheme == "topk":
            values = sum(scheme.kept(n) for n in numels)
            indices = values
        else:
            indices = sum(scheme.kept(n) for n in numels)
            values = indices * scheme.block
        for position, size in enumerate(sizes):
            gathered *= size
            calls.append(
                WireCall("all_gather", position, "float32", 4.0 * values * gathered, "values")
            )
            calls.append(
                WireCall("all_gather", position, "int32", 4.0 * indices * gathered, "indices")
            )
    elif scheme.scheme == "powersgd":
        p = sum(matrix_shape(s)[0] * scheme.rank for s in shapes)
        q = sum(matrix_shape(s)[1] * scheme.rank for s in shapes)
        for position, _ in enumerate(sizes):
            calls.append(WireCall("all_reduce", position, "float32", 4.0 * p, "P"))
        for position, _ in enumerate(sizes):
            calls.append(WireCall("all_reduce", position, "float32", 4.0 * q, "Q"))
    return calls


def state_values(scheme: GradCompression, shape: Sequence[int]) -> int:
    """fp32 values a scheme keeps per gradient of ``shape`` between steps."""
    if not scheme.compresses(shape):
        return 0
    numel = math.prod(shape)
    if scheme.scheme == "topk":
        return numel * (2 if scheme.momentum else 1)
    if scheme.scheme == "block_topk":
        return numel
    if scheme.scheme == "powersgd":
        return numel + matrix_shape(shape)[1] * scheme.rank
    return 0


def encode_passes(scheme: GradCompression) -> float:
    """Gradient-sized passes over memory (reads and writes, in fp32 values) to encode and
    decode one gradient: the memory-bound work a scheme adds to a step."""
    momentum = 3.0 if scheme.scheme == "topk" and scheme.momentum else 0.0  # u = m u + g
    return momentum + {
        "terngrad": 6.0,  # |g| max, std, clip, rounding draw, levels, decode
        "topk": 8.0,  # add residual (3), select (1), scatter back and zero residual (4)
        "block_topk": 8.0,
        "powersgd": 6.0,  # add residual, M Q, M^T P, P Q^T, residual (ignoring the rank)
    }.get(scheme.scheme, 0.0)
