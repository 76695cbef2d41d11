"""Trace time and planning speed: every model on meshes of 8 to 1024 H100s; depth sweep.

    python -m benchmarks --only trace speed [--quick]

Each model is built on ``meta`` with its loss (``benchmarks.common.WithLoss``) and the
preset's example batch of one sequence, traced once (the trace table), then planned on each
mesh without a pipeline (``stages=1``), bf16 mixed precision, AdamW, 80 GiB per device:

- ``solve``: strategies, decisions, the ILP and HiGHS (again under the memory limit, with
  ZeRO and recomputation, when the fastest plan does not fit), and the plan;
- ``lower``: rank 0's program (``PlanLayouts`` and ``lower_spmd``, as ``autopar.compile``);
- ``ILP``: the variables and constraints of the solve that made the plan, and what one
  binary per strategy and one variable per strategy pair would take (Alpa's formulation).

A model whose parameter, gradient and AdamW state alone (16 bytes per parameter, fully
sharded) exceed 80 GiB per device is not planned on that mesh: the row says so. The depth
sweep plans llama3-8b with 8 to 96 layers on 8x8.
"""

from __future__ import annotations

import time
from typing import Any

from autopar_passes.from_plan import PlanLayouts
from autopar_passes.lower_spmd import lower_spmd
from autopar_passes.lower_stages import stage_mesh
from autopar_plans.errors import InfeasiblePlanError
from autopar_plans.units import parse_bytes
from benchmarks.common import MEMORY_LIMIT, MESHES, MODELS, cluster, plan_traced, trace_with_loss

DEPTHS = (8, 16, 32, 64, 96)
QUICK_MODELS = ("gpt2-124m",)
QUICK_MESHES = (8, 64)
QUICK_DEPTHS = (2, 4)
STATE_BYTES_PER_PARAM = 16  # fp32 master weights and gradients, AdamW's two moments


def trace_rows(models: tuple[str, ...]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Trace each model once; its row, and the traced models for planning."""
    rows, traced_models = [], {}
    for name in models:
        cpu = time.process_time()
        traced, seconds = trace_with_loss(name, 1)
        summary = traced.summary()
        rows.append(
            {
                "model": name,
                "trace_s": seconds,
                "trace_cpu_s": time.process_time() - cpu,
                "nodes": summary.nodes,
                "parameters": summary.parameters,
                "fwd_flops": summary.fwd_flops,
                "layers": traced.layers.count if traced.layers else 0,
            }
        )
        traced_models[name] = traced
    return rows, traced_models


def plan_row(
    name: str, traced: Any, devices: int, trace_s: float, trace_cpu_s: float
) -> dict[str, Any]:
    """Solve and lower ``traced`` on ``devices`` H100s; the timings and the ILP's size."""
    mesh = cluster(devices)
    row: dict[str, Any] = {
        "model": name,
        "devices": devices,
        "mesh": "x".join(map(str, mesh.shape)),
        "layers": traced.layers.count if traced.layers else 0,
        "trace_s": trace_s,
        "trace_cpu_s": trace_cpu_s,
    }
    params = sum(info.numel for info in traced.params.values())
    floor = params * STATE_BYTES_PER_PARAM / devices
    if floor > parse_bytes(MEMORY_LIMIT):
        row["status"] = f"does not fit: {floor / 2**30:.0f} GiB of states per device"
        return row
    start, cpu = time.perf_counter(), time.process_time()
    try:
        plan = plan_traced(traced, mesh, global_batch=1, traced_batch=1, stages=1, name=name)
    except InfeasiblePlanError as error:
        row["status"] = "infeasible"
        row["solve_s"] = time.perf_counter() - start
        row["error"] = str(error)
        return row
    solved_at = time.perf_counter()
    layouts = PlanLayouts(traced, plan)
    lower_spmd(traced, layouts.strategy, layouts.layout, stage_mesh(plan), (0,) * mesh.ndim)
    done = time.perf_counter()
    row.update(
        cpu_s=trace_cpu_s + time.process_time() - cpu,
        status="ok",
        solve_s=solved_at - start,
        lower_s=done - solved_at,
        total_s=trace_s + done - start,
        ilp_s=plan.solver.time_s,
        variables=plan.solver.variables,
        constraints=plan.solver.constraints,
        unreduced=plan.solver.variables_before_merging or 0,
        solver_status=plan.solver.status,
        parallelism=plan.parallelism.model_dump(),
        mfu=plan.estimate.mfu,
    )
    return row


def depth_rows(depths: tuple[int, ...], devices: int) -> list[dict[str, Any]]:
    rows = []
    for depth in depths:
        cpu = time.process_time()
        traced, seconds = trace_with_loss("llama3-8b", 1, n_layer=depth)
        cpu = time.process_time() - cpu
        rows.append(plan_row(f"llama3-8b/{depth}", traced, devices, seconds, cpu))
    return rows


def run(quick: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trace section's record and the planning-speed section's record."""
    models = QUICK_MODELS if quick else MODELS
    meshes = QUICK_MESHES if quick else MESHES
    start = time.perf_counter()
    traces, traced_models = trace_rows(models)
    trace_record = {"rows": traces, "seconds": time.perf_counter() - start}
    start = time.perf_counter()
    grid = []
    for row in traces:
        for devices in meshes:
            grid.append(
                plan_row(
                    row["model"],
                    traced_models[row["model"]],
                    devices,
                    row["trace_s"],
                    row["trace_cpu_s"],
                )
            )
    traced_models.clear()
    depth = depth_rows(QUICK_DEPTHS if quick else DEPTHS, 64)
    speed_record = {"grid": grid, "depth": depth, "seconds": time.perf_counter() - start}
    return trace_record, speed_record
