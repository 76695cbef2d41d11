"""Published closed forms for GPT models, used by tests and benchmarks as ground truth.

All from Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC'21), for a GPT with ``l`` layers, hidden size ``h``,
vocabulary ``V``, sequence length ``s`` and batch ``B`` (attention heads do not matter):

- parameters (Sec. 5.1): ``P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))``;
- GEMM FLOPs per iteration (Appendix): ``72 B s l h^2 (1 + s / (6 h) + V / (12 l h))``, with
  full activation recomputation (one more forward of every layer)
  ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))``;
- tensor-parallel traffic per layer per device (Sec. 3.2): two all-reduces of ``b s h``
  values in the forward and two in the backward, each sending ``2 (t - 1) / t`` of its
  size: ``8 b s h (t - 1) / t`` values.

They count only the GEMMs (no softmax, norms, or optimizer), as does ``mfu``'s numerator.

>>> round(gpt_params(l=96, h=12288, V=51200, s=2048) / 1e9, 1)   # GPT-3 "175B"
174.6
"""

from __future__ import annotations


def gpt_params(l: int, h: int, V: int, s: int) -> float:  # noqa: E741
    """Parameters of a GPT: ``12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))``.

    Per layer ``12 h^2`` weights (QKV 3h^2, projection h^2, MLP 8h^2) and ``13 h`` biases and
    norm scales; token and position embeddings ``(V + s) h``.
    """
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def gpt_flops_per_iteration(
    B: int,
    s: int,
    l: int,  # noqa: E741
    h: int,
    V: int,
    *,
    recompute: bool = False,
) -> float:
    """GEMM FLOPs of one training iteration (forward + backward) of a GPT.

    ``72 B s l h^2 (1 + s / (6 h) + V / (12 l h))``, or with full recomputation
    ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))``.
    """
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def tp_traffic_per_layer(b: int, s: int, h: int, t: int, bytes_per_value: float = 1.0) -> float:
    """Values (times ``bytes_per_value``) each device sends per layer per microbatch under
    ``t``-way tensor parallelism, forward and backward: ``8 b s h (t - 1) / t``."""
    return 8 * b * s * h * (t - 1) / t * bytes_per_value
