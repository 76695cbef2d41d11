"""The sections that are not a module of their own: the pipeline search, the recompute
frontier (``recompute_frontier.py`` as it prints), the H200 results read from their files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import autopar
from benchmarks.common import MEMORY_LIMIT, PRECISION, build_with_loss, cluster

ROOT = Path(__file__).resolve().parents[1]
H200 = Path("benchmarks/results/h200")
FRONTIER_PNG = Path("benchmarks/frontier.png")

# Megatron-LM's 175B run: batch 1536 (Narayanan et al. 2021); example batch 8 sequences
PIPELINE = {"model": "gpt3-175b", "nodes": 128, "global_batch": 1536, "example_batch": 8}
QUICK_PIPELINE = {"model": "gpt-tiny", "nodes": 4, "global_batch": 16, "example_batch": 4}


def pipeline(quick: bool = False) -> dict[str, Any]:
    """``autopar.plan`` with the whole search (stages, schedule, microbatches), timed from
    the model on meta to the plan (trace included)."""
    case = QUICK_PIPELINE if quick else PIPELINE
    model, inputs = build_with_loss(case["model"], case["example_batch"])
    mesh = cluster(case["nodes"] * 8)
    start, cpu = time.perf_counter(), time.process_time()
    plan = autopar.plan(
        model,
        mesh,
        inputs,
        global_batch=case["global_batch"],
        precision=PRECISION,
        memory_limit=MEMORY_LIMIT,
    )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    p, e = plan.parallelism, plan.estimate
    return {
        **case,
        "mesh": "x".join(map(str, mesh.shape)),
        "plan_s": seconds,
        "plan_cpu_s": cpu,
        "parallelism": p.model_dump(),
        "microbatch": plan.microbatch_size,
        "step_s": e.step_time_s,
        "mfu": e.mfu,
        "bubble_s": e.bubble_s,
        "memory_gib": e.memory_per_device_bytes.total / 2**30,
        "recompute": sorted({f"{r.kind} x{len(r.layers)}" for r in plan.recompute}),
        "solver": plan.solver.status,
        "alternatives": [
            {
                "parallelism": a.parallelism.model_dump(),
                "step_s": a.step_time_s,
                "note": a.note,
            }
            for a in plan.alternatives[:4]
        ],
    }


def frontier(quick: bool = False) -> dict[str, Any]:
    """Run ``benchmarks/recompute_frontier.py`` and keep its table (and plot)."""
    if quick:
        return {"skipped": "not run with --quick"}
    # as a module from the root, so it imports this checkout whether or not it is installed
    command = [sys.executable, "-m", "benchmarks.recompute_frontier", "--out", str(FRONTIER_PNG)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    record = {
        "stdout": done.stdout,
        "plot": str(FRONTIER_PNG),
        "seconds": time.perf_counter() - start,
        "returncode": done.returncode,
    }
    if done.returncode:
        record["stderr_tail"] = done.stderr[-3000:]
    return record


def gpu() -> dict[str, Any]:
    """The saved H200 run: ``gpu.json`` (benchmarks/gpu.py), ``check_nccl.log``
    (tests/gpu/check_nccl.py) and ``matmul_alignment.txt`` (benchmarks/gpu_alignment.py).
    Nothing is measured here."""
    data = json.loads((ROOT / H200 / "gpu.json").read_text())
    log = (ROOT / H200 / "check_nccl.log").read_text()
    alignment = ROOT / H200 / "matmul_alignment.txt"
    return {
        "gpu": data,
        "check_nccl": log,
        "matmul_alignment": alignment.read_text() if alignment.exists() else None,
        "files": [str(H200 / n) for n in _h200_files()],
    }


def _h200_files() -> list[str]:
    return sorted(p.name for p in (ROOT / H200).iterdir() if p.is_file())
