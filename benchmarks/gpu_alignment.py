"""GPU benchmark: bf16 matmul speed against the alignment of its output dimension.

    python benchmarks/gpu_alignment.py > benchmarks/results/h200/matmul_alignment.txt

The lm_head of the GPT presets (vocabulary 50257) is the op the cost model misses most on
the H200 (``benchmarks/gpu.py``'s op table). This times the three matmuls of a linear layer
(forward, input gradient, weight gradient) of a 16384 x 2048 input against an N x 2048
weight for N around 50257 and 8192, in bf16 with CUDA events (median of 20 after 3
warm-ups), and prints one line per N with its remainders modulo 8 and 64, so the rate can
be read against how many bytes the rows are aligned to.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

SIZES = (50257, 50258, 50260, 50264, 50272, 50304, 50432, 8191, 8192, 8200, 6144, 6145)


def cuda_ms(work: Callable[[], object], repeat: int = 20) -> float:
    """Median milliseconds of ``work`` between two CUDA events."""
    for _ in range(3):
        work()
    samples = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop))
    return statistics.median(samples)


def main() -> None:
    rows, inner = 16384, 2048
    x = torch.randn(rows, inner, device="cuda", dtype=torch.bfloat16)
    for n in SIZES:
        weight = torch.randn(n, inner, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        forward = cuda_ms(lambda w=weight: x @ w.t())
        dgrad = cuda_ms(lambda g=grad, w=weight: g @ w)
        wgrad = cuda_ms(lambda g=grad: g.t() @ x)
        flops = 2 * rows * n * inner
        print(
            f"N={n} mod8={n % 8} mod64={n % 64} fwd {forward:.3f} ms "
            f"({flops / forward / 1e9:.0f} TF/s) dgrad {dgrad:.3f} ms ({flops / dgrad / 1e9:.0f}) "
            f"wgrad {wgrad:.3f} ms ({flops / wgrad / 1e9:.0f})"
        )


if __name__ == "__main__":
    main()
