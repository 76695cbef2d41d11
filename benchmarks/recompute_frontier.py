"""Memory against step time: sweep the memory limit for one model, roomy to tight.

    python benchmarks/recompute_frontier.py [--out benchmarks/frontier.png]

Plans gpt3-1.3b (8 sequences of 2048 per microbatch, 32 per step, bf16 mixed precision,
AdamW) on one node of 8 H100s under a falling memory limit and prints, per limit, what the
planner chose (sharding, ZeRO, recompute, offload to host memory, microbatches) with its
estimated step time and memory per device (and on the host); plots the frontier, each
point marked by what entered there. Below the floor it prints the planner's error.
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

import autopar
from autopar_examples.models import build
from autopar_plans import InfeasiblePlanError
from benchmarks.render import save_figure

LIMITS_GIB = [80, 40, 24, 16, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1.5, 1, 0.75, 0.5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/frontier.png"))
    args = parser.parse_args()
    model, inputs = build("gpt3-1.3b", device="meta", batch_size=8)
    mesh = autopar.Mesh((8,), ("gpu",), device="h100-sxm")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; gpt3-1.3b on 8 x H100, "
        "global batch 32, bf16 mixed, AdamW"
    )
    print()
    print(
        "| memory limit | step (ms) | memory / device | activations | dp x tp x pp | zero "
        "| microbatches x size | recompute | offload | host / device |"
    )
    print("|---:|---:|---:|---:|---|---:|---|---|---|---:|")
    points = []
    for limit in LIMITS_GIB:
        try:
            plan = autopar.plan(
                model,
                mesh,
                inputs,
                global_batch=32,
                precision="bf16_mixed",
                memory_limit=f"{limit}GiB",
            )
        except InfeasiblePlanError as error:
            print(
                f"| {limit} GiB | infeasible: {str(error).split(':', 1)[1].strip()} "
                "| | | | | | | | |"
            )
            continue
        e, p = plan.estimate, plan.parallelism
        kinds = sorted({f"{r.kind} x{len(r.layers)}" for r in plan.recompute})
        recompute = ", ".join(kinds) if kinds else "none"
        total = e.memory_per_device_bytes.total / 2**30
        offload = plan.offload.describe() if plan.offload.active else "none"
        entered = (
            "offload"
            if plan.offload.active
            else "recompute"
            if kinds
            else (f"ZeRO-{p.zero}" if p.zero else "plain")
        )
        points.append((total, e.step_time_s * 1e3, limit, entered))
        host = e.memory_per_device_bytes.host / 2**30
        print(
            f"| {limit} GiB | {e.step_time_s * 1e3:.1f} | {total:.1f} GiB "
            f"| {e.memory_per_device_bytes.activations / 2**30:.1f} GiB "
            f"| {p.dp} x {p.tp} x {p.pp} | {p.zero} | {p.microbatches} x "
            f"{plan.microbatch_size} | {recompute} | {offload} | {host:.1f} GiB |"
        )
    figure, axes = plt.subplots(figsize=(6, 3.6), dpi=100)
    axes.plot([m for m, *_ in points], [t for _, t, *_ in points], "-", color="0.6", zorder=1)
    for kind, marker in (
        ("plain", "o"),
        ("ZeRO-1", "s"),
        ("ZeRO-2", "s"),
        ("ZeRO-3", "D"),
        ("recompute", "^"),
        ("offload", "v"),
    ):
        chosen = [(m, t) for m, t, _, k in points if k == kind]
        if chosen:
            axes.scatter(*zip(*chosen, strict=True), marker=marker, label=kind, zorder=2)
    axes.legend(fontsize=7)
    for memory, step, limit, _ in points:
        axes.annotate(
            f"{limit} GiB", (memory, step), textcoords="offset points", xytext=(4, 4), fontsize=7
        )
    axes.set_xlabel("planned memory per device (GiB)")
    axes.set_ylabel("estimated step time (ms)")
    axes.set_yscale("log")
    axes.set_title("gpt3-1.3b on 8 x H100: memory limit against step time")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    save_figure(figure, args.out)
    print()
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
