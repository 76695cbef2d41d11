"""Trace time of full-size presets on the meta device (issue: foundation).

    python benchmarks/trace_time.py [--repeat 3] [MODEL ...]

Builds each preset on ``meta`` (no weights), traces it with ``autopar_passes.trace.trace`` and
prints a markdown table: median seconds over ``--repeat`` runs (model build excluded),
graph nodes, parameters, forward FLOPs. Target: llama3-8b under 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from autopar_examples.models import build
from autopar_passes.trace import trace

DEFAULT = ["gpt2-124m", "llama3-8b", "llama3-70b", "gpt3-175b", "mixtral-8x7b"]


def measure(name: str, repeat: int) -> tuple[float, int, int, int]:
    seconds = []
    for _ in range(repeat):
        model, inputs = build(name, device="meta")
        start = time.perf_counter()
        traced = trace(model, inputs)
        seconds.append(time.perf_counter() - start)
    summary = traced.summary()
    return statistics.median(seconds), summary.nodes, summary.parameters, summary.fwd_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", default=DEFAULT)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    build("gpt-tiny")  # import and warm up torch.export once, outside the timings
    trace(*build("gpt-tiny"))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; median of {args.repeat}"
    )
    print()
    print("| model | trace time (s) | graph nodes | parameters | forward TFLOP |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models:
        seconds, nodes, params, flops = measure(name, args.repeat)
        print(f"| {name} | {seconds:.2f} | {nodes} | {params / 1e9:.2f}B | {flops / 1e12:.1f} |")


if __name__ == "__main__":
    main()
