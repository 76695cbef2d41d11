"""Planning time: trace, strategies, ILP, plan; ILP size before and after the reductions.

    python benchmarks/planning.py [--repeat 3]

Each row plans a preset built on ``meta`` (no weights) on a mesh of H100 presets, median of
``--repeat`` runs (the first run of the process is discarded as warm-up), and prints a
markdown table. Targets (sharding issue): llama3-8b on 8x8 under 5 s; gpt3-175b on 128x8
under 20 s; time close to flat in depth.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import autopar
from autopar_examples.models import build
from autopar_passes.plan_build import build_plan
from autopar_passes.solve import SolveRequest, solve_sharding
from autopar_passes.trace import trace

CASES = [
    ("llama3-8b", (8, 8), {}),
    ("gpt3-175b", (128, 8), {}),
    ("llama3-8b", (8, 8), {"n_layer": 8}),
    ("llama3-8b", (8, 8), {"n_layer": 32}),
    ("llama3-8b", (8, 8), {"n_layer": 96}),
]


def plan_once(name: str, shape: tuple[int, int], overrides: dict) -> dict[str, float]:
    model, inputs = build(name, device="meta", **overrides)
    mesh = autopar.Mesh.cluster(shape[0], shape[1], device="h100-sxm")
    start = time.perf_counter()
    traced = trace(model, inputs)
    traced_at = time.perf_counter()
    solved = solve_sharding(traced, SolveRequest(mesh, mesh_memory(mesh)))
    solved_at = time.perf_counter()
    plan = build_plan(
        traced, solved, model=name, global_batch=1, microbatch_size=1, memory_limit=None
    )
    done = time.perf_counter()
    return {
        "trace": traced_at - start,
        "solve": solved_at - traced_at,
        "ilp": plan.solver.time_s,
        "total": done - start,
        "variables": plan.solver.variables,
        "before": plan.solver.variables_before_merging or 0,
        "mfu": plan.estimate.mfu,
        "layers": len(model.layers),
    }


PIPELINE_CASES = [
    # (model, cluster, global batch, example batch = largest microbatch)
    ("gpt3-175b", (128, 8), 1536, 8),  # Megatron-LM's 175B run: batch 1536 (Narayanan 2021)
    ("llama3-70b", (8, 8), 512, 4),
]


def plan_pipeline_once(
    name: str, shape: tuple[int, int], global_batch: int, batch: int
) -> tuple[float, autopar.Plan]:
    model, inputs = build(name, device="meta", batch_size=batch)
    mesh = autopar.Mesh.cluster(shape[0], shape[1], device="h100-sxm")
    start = time.perf_counter()
    plan = autopar.plan(
        model, mesh, inputs, global_batch=global_batch, precision="bf16_mixed", memory_limit="80GiB"
    )
    return time.perf_counter() - start, plan


def mesh_memory(mesh: autopar.Mesh) -> float:
    from autopar_cost_model.hardware import load_preset

    return load_preset(mesh.device).memory_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-pipeline", action="store_true")
    args = parser.parse_args()
    plan_once("gpt-tiny", (1, 2), {})  # warm-up: imports, first export
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__};"
        f" median of {args.repeat}"
    )
    print()
    print(
        "| model | layers | mesh | total (s) | trace (s) | solve (s) | of which ILP (s) "
        "| ILP variables | without merging and sharing | est. MFU |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, shape, overrides in CASES:
        runs = [plan_once(name, shape, overrides) for _ in range(args.repeat)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {name} | {int(med['layers'])} | {shape[0]}x{shape[1]} | {med['total']:.2f} "
            f"| {med['trace']:.2f} | {med['solve']:.2f} | {med['ilp']:.2f} "
            f"| {int(med['variables'])} | {int(med['before'])} | {100 * med['mfu']:.1f}% |"
        )
    if not args.skip_pipeline:
        pipeline_table(max(1, args.repeat // 2))


def pipeline_table(repeat: int) -> None:
    print()
    print(
        "| model | cluster | global batch | planning (s) | chosen dp x tp x pp (sp, zero) "
        "| schedule | microbatches x size | est. step (s) | est. MFU | runner-up |"
    )
    print("|---|---|---:|---:|---|---|---|---:|---:|---|")
    for name, shape, global_batch, batch in PIPELINE_CASES:
        runs = [plan_pipeline_once(name, shape, global_batch, batch) for _ in range(repeat)]
        seconds = statistics.median(r[0] for r in runs)
        plan = runs[-1][1]
        p = plan.parallelism
        second = plan.alternatives[0] if plan.alternatives else None
        runner = (
            f"pp={second.parallelism.pp} {second.parallelism.schedule}, {second.step_time_s:.2f} s"
            if second
            else "-"
        )
        print(
            f"| {name} | {shape[0]}x{shape[1]} H100 | {global_batch} | {seconds:.1f} "
            f"| {p.dp} x {p.tp} x {p.pp} (sp {p.sp}, zero {p.zero}) | {p.schedule} "
            f"| {p.microbatches} x {plan.microbatch_size} | {plan.estimate.step_time_s:.2f} "
            f"| {100 * plan.estimate.mfu:.1f}% | {runner} |"
        )


if __name__ == "__main__":
    main()
