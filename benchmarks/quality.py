"""Plan quality: autopar's plan next to the hand-written layouts users would otherwise pick.

    python -m benchmarks --only quality [--full | --quick]

Every plan is costed by the same cost model (H100 presets, bf16 mixed precision, AdamW,
80 GiB per device, the loss inside the model) for the same global batch. The baselines are
autopar plans whose layouts are forced (``benchmarks.common.plan_traced``):

- **DDP**: ``force="dp"``, ZeRO off, no pipeline.
- **FSDP (ZeRO-3)**: ``force="fsdp"``, no pipeline.
- **Megatron TP (node) x DP**: ``force="tp"`` on the node's 8 devices (weights split,
  residual stream replicated: Megatron's column and row splits) with a hint banning batch
  and sequence splits on the tp axis (``force="tp"`` alone allows them), data parallelism
  across nodes with the distributed optimizer (ZeRO-1), no pipeline.
- **GShard EP (node) x DP**, for a mixture-of-experts model: ``force="ep"`` on the
  cluster mesh, the experts split over a node's 8 devices (one expert per GPU for Mixtral's
  8) and replicated across nodes, every other matmul data-parallel over all devices, tokens
  to their experts and back by all-to-all inside the node (GShard, Lepikhin et al. 2020;
  DeepSpeed-MoE's and Megatron's expert parallelism), ZeRO stage 0, 1 or 2, whichever is
  fastest (DeepSpeed-MoE runs expert parallelism with ZeRO-2, Megatron with its
  distributed optimizer, ZeRO-1), no pipeline.
- **Megatron 3-D, best of a grid**: tp in {1, 2, 4, 8} inside a node (with sequence
  parallelism where tp > 1), pp over powers of two (stopping once more stages stop
  helping), dp the rest, ZeRO-1; one sequence per data-parallel rank per microbatch, so
  ``global batch / dp`` microbatches; for each (tp, pp) the pipeline search picks the
  schedule (GPipe, 1F1B, interleaved 1F1B) and the stage cut. The fastest configuration
  that fits is the baseline.

What could not be expressed exactly, and how it is approximated:

- recomputation is not a knob (autopar takes no recompute hints yet): every plan, baselines
  included, recomputes what the ILP chooses when memory binds, which is at least as good as
  any fixed choice of none, selective or full for that layout;
- tp = 2 or 4 on more than one node runs on a (dp x pp, tp) mesh whose outer axis is costed
  as a flat ring at the inter-node link (the cost model has no partly-intra-node axis),
  which overstates its data-parallel traffic a little;
- autopar's own search cuts pipeline stages into blocks of consecutive devices (whole
  nodes, then parts of a node, as Megatron orders its ranks with the pipeline outermost);
  its microbatches are the example batch halved while it divides by a stage's devices, and,
  on the model traced again, from one sequence per node of a stage up to those;
- where a forced split does not divide a model's dims (gpt2-124m's 12 heads over 8
  devices), the forced plan is the best the constraints allow, and its summary may read
  tp 1.

autopar gets the cluster mesh (nodes x 8 GPUs) and example inputs of one sequence per device
(so plain data parallelism is in its space), and searches everything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import autopar
from autopar_examples.models.presets import PRESETS
from autopar_passes.trace import TracedModel
from autopar_plans.errors import AutoparError, InfeasiblePlanError
from autopar_plans.plan import Plan
from autopar_plans.units import parse_bytes
from benchmarks.common import (
    MEMORY_LIMIT,
    MESHES,
    MODELS,
    PRESET,
    cluster,
    machine,
    plan_traced,
    trace_with_loss,
)

# (model, devices): each model on the meshes it is usually trained on (the default run)
DEFAULT_CASES = (
    ("gpt2-124m", 8),
    ("llama3-8b", 64),
    ("llama3-70b", 512),
    ("gpt3-175b", 1024),
    ("mixtral-8x7b", 64),
)
QUICK_CASES = (("gpt-tiny", 8), ("moe-tiny", 4))  # moe-tiny: 4 experts, one per device
# global batch in sequences: tokens per step as the models' papers (GPT-3 Table 2.1,
# Llama 3 Sec. 3.4.1), at least one sequence per device
GLOBAL_BATCH = {
    "gpt-tiny": 16,
    "moe-tiny": 16,
    "gpt2-124m": 512,
    "gpt3-1.3b": 512,
    "gpt3-6.7b": 1024,
    "gpt3-13b": 1024,
    "gpt3-175b": 1536,
    "llama3-8b": 512,
    "llama3-70b": 512,
    "mixtral-8x7b": 1024,
}
# the trace's config beyond the preset: Mixtral routed in GShard groups of 1024 tokens, as
# the mixture-of-experts section plans it (the preset's default is a group per sequence)
TRACE_OVERRIDES: dict[str, dict[str, Any]] = {"mixtral-8x7b": {"group_size": 1024}}
# (record key, column, short name): the baselines, in the tables' order; a model that is
# not a mixture of experts has no EP x DP entry
BASELINES = (
    ("ddp", "DDP", "DDP"),
    ("fsdp", "FSDP (ZeRO-3)", "FSDP"),
    ("tp_dp", "Megatron TP (node) x DP", "TP x DP"),
    ("ep_dp", "GShard EP (node) x DP", "EP x DP"),
    ("megatron", "Megatron 3-D (best of grid)", "Megatron 3-D"),
)
TP_SIZES = (1, 2, 4, 8)
GPUS_PER_NODE = 8
KEEP_TRACES = 6


def global_batch(model: str, devices: int) -> int:
    """The model's batch, rounded up to a whole sequence per device (plain DP's minimum)."""
    return -(-GLOBAL_BATCH[model] // devices) * devices


class Traces:
    """One trace per (model, batch), reused by every plan that needs it."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.cache: dict[int, TracedModel] = {}
        self.seconds = 0.0

    def get(self, batch: int) -> TracedModel:
        if batch not in self.cache:
            if len(self.cache) >= KEEP_TRACES:  # each holds a graph's metadata (~1 GB at most)
                self.cache.pop(next(iter(self.cache)))
            traced, seconds = trace_with_loss(
                self.model, batch, **TRACE_OVERRIDES.get(self.model, {})
            )
            self.cache[batch] = traced
            self.seconds += seconds
        return self.cache[batch]


def summarize(
    plan: Plan | None,
    seconds: float,
    cpu: float,
    error: str | None = None,
    status: str = "does not fit",
) -> dict[str, Any]:
    if plan is None:
        return {"status": status, "error": error, "plan_s": seconds, "plan_cpu_s": cpu}
    p, e = plan.parallelism, plan.estimate
    m = e.memory_per_device_bytes
    states = (m.params + m.grads + m.optimizer) / 2**30
    # a plan whose memory adds up only with negative activations does not fit (a bug in
    # the recompute accounting, reported); it is shown, never counted as a winner
    valid = m.activations >= 0
    return {
        "status": "ok" if valid else "invalid",
        "error": None if valid else f"activations {m.activations / 2**30:.1f} GiB < 0",
        "states_gib": states,
        "activations_gib": m.activations / 2**30,
        "plan_s": seconds,
        "plan_cpu_s": cpu,
        "step_s": e.step_time_s,
        "mfu": e.mfu,
        "memory_gib": e.memory_per_device_bytes.total / 2**30,
        "dp": p.dp,
        "tp": p.tp,
        "pp": p.pp,
        "sp": p.sp,
        "ep": p.ep,
        "zero": p.zero,
        "schedule": p.schedule,
        "chunks": p.chunks,
        "microbatches": p.microbatches,
        "microbatch": plan.microbatch_size,
        "recompute": sorted({f"{r.kind} x{len(r.layers)}" for r in plan.recompute}),
        "solver": plan.solver.status,
    }


def _try(make: Any) -> dict[str, Any]:
    start, cpu = time.perf_counter(), time.process_time()

    def took() -> tuple[float, float]:
        return time.perf_counter() - start, time.process_time() - cpu

    try:
        plan = make()
    except InfeasiblePlanError as error:
        return summarize(None, *took(), _first_line(error))
    except AutoparError as error:  # a layout the model's shapes do not allow
        return summarize(None, *took(), _first_line(error), "error")
    return summarize(plan, *took())


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:300]


def megatron_mesh(devices: int, tp: int) -> autopar.Mesh:
    """(dp x pp, tp) devices; the tp axis inside a node. tp = 1 on several nodes keeps the
    cluster's (nodes, 8) mesh so data parallelism is costed hierarchically."""
    if tp == GPUS_PER_NODE or (tp == 1 and devices > GPUS_PER_NODE):
        return cluster(devices)
    return autopar.Mesh(
        (devices // tp, tp),
        ("dp", "tp"),
        device=PRESET,
        gpus_per_node=GPUS_PER_NODE,
    )


def megatron_hints(mesh: autopar.Mesh) -> dict[str, Any]:
    """Megatron's layout beyond ``force="tp"``, which lets the solver split the batch (or
    the sequence) on the tp axis too, FSDP-like: ban that. (Weights are already replicated
    on the data axis by the style.)"""
    return {"ban": {mesh.axis_names[-1]: ["data_parallel"]}}


def states_floor(params: int, shards: int, dp: int) -> float:
    """Bytes per device of fp32 weights and gradients split ``shards`` ways and AdamW's
    moments ``shards x dp`` ways (ZeRO-1): a lower bound that skips hopeless configs."""
    return params * (8 / shards + 8 / (shards * dp))


def megatron_grid(
    traces: Traces, devices: int, batch: int, layers: int, params: int
) -> list[dict[str, Any]]:
    """Every (tp, pp) tried, each with the best schedule and cut the search finds."""
    rows = []
    limit = parse_bytes(MEMORY_LIMIT)
    for tp in TP_SIZES:
        if tp > min(devices, GPUS_PER_NODE):
            continue
        mesh = megatron_mesh(devices, tp)
        outer = mesh.shape[0]
        best_step = None
        pp = 1
        while pp <= min(outer, layers):
            if outer % pp:
                break
            dp = devices // (tp * pp)
            row: dict[str, Any] = {"tp": tp, "pp_tried": pp, "dp_tried": dp}
            if states_floor(params, tp * pp, dp) > limit or batch % dp:
                row.update(status="does not fit", error="states alone exceed the limit")
                rows.append(row)
                pp *= 2
                continue
            traced = traces.get(dp)  # one sequence per data-parallel rank per microbatch
            force = "tp+sp" if tp > 1 else "dp"
            hints = megatron_hints(mesh) if tp > 1 else None
            row.update(
                _try(
                    lambda traced=traced, force=force, hints=hints, pp=pp, mesh=mesh: plan_traced(
                        traced,
                        mesh,
                        global_batch=batch,
                        traced_batch=traced_batch_of(traced),
                        force=force,
                        hints=hints,
                        stages=pp,
                        zero=1,
                    )
                )
            )
            rows.append(row)
            if row["status"] == "ok":
                if best_step is not None and row["step_s"] > best_step:
                    break  # past the best stage count for this tp
                best_step = row["step_s"] if best_step is None else min(best_step, row["step_s"])
            pp *= 2
    return rows


def traced_batch_of(traced: TracedModel) -> int:
    from autopar.api import _batch_size

    return _batch_size(traced)


def run_case(model: str, devices: int) -> dict[str, Any]:
    """autopar and every baseline for ``model`` on ``devices`` H100s."""
    start = time.perf_counter()
    batch = global_batch(model, devices)
    traces = Traces(model)
    mesh = cluster(devices)
    example = min(devices, batch)
    traced = traces.get(example)
    layers = traced.layers.count if traced.layers else 1
    params = sum(info.numel for info in traced.params.values())
    case: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": machine()["commit"],
        "model": model,
        "devices": devices,
        "mesh": "x".join(map(str, mesh.shape)),
        "global_batch": batch,
        "example_batch": example,
    }
    common = {"global_batch": batch, "traced_batch": example}
    case["autopar"] = _try(
        lambda: plan_traced(traced, mesh, **common, name=model, retrace=traces.get)
    )
    case["ddp"] = _try(lambda: plan_traced(traced, mesh, **common, force="dp", zero=0))
    case["fsdp"] = _try(lambda: plan_traced(traced, mesh, **common, force="fsdp", zero=0))
    tp = min(devices, GPUS_PER_NODE)
    dp = devices // tp
    if batch % dp == 0:
        tp_traced = traces.get(dp)
        case["tp_dp"] = _try(
            lambda: plan_traced(
                tp_traced,
                mesh,
                global_batch=batch,
                traced_batch=dp,
                force="tp",
                hints=megatron_hints(mesh),
                stages=1,
                zero=1,
            )
        )
    if is_moe(model):
        case["ep_dp"] = _try(lambda: plan_traced(traced, mesh, **common, force="ep", stages=1))
    grid = megatron_grid(traces, devices, batch, layers, params)
    case["megatron_grid"] = grid
    fitting = [r for r in grid if r.get("status") == "ok"]  # invalid plans never count
    case["megatron"] = (
        min(fitting, key=lambda r: r["step_s"]) if fitting else {"status": "does not fit"}
    )
    diagnose(case, traces)
    case["trace_s"] = traces.seconds
    case["seconds"] = time.perf_counter() - start
    return case


def is_moe(model: str) -> bool:
    """Whether the preset is a mixture of experts (its config names experts)."""
    return "n_experts" in PRESETS[model].config


def best_baseline(case: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest baseline of ``case`` that fits (``invalid`` plans never count)."""
    fitting = [case[key] for key, _, _ in BASELINES if case.get(key, {}).get("status") == "ok"]
    return min(fitting, key=lambda e: e["step_s"]) if fitting else None


def diagnose(case: dict[str, Any], traces: Traces | None = None) -> None:
    """Where autopar loses: plan again with example inputs of the winning baseline's
    microbatch (autopar's largest microbatch is its example batch, and it splits it only
    while a stage's devices divide it), to tell the search's reach from its microbatches."""
    best = best_baseline(case)
    mine = case["autopar"]
    lost = best is not None and (mine.get("status") != "ok" or mine["step_s"] > best["step_s"])
    if (
        not lost
        or "autopar_at_baseline_batch" in case
        or best["microbatch"] == mine.get("microbatch")
    ):
        return
    traces = traces or Traces(case["model"])
    traced = traces.get(best["microbatch"])
    mesh = cluster(case["devices"])
    entry = _try(
        lambda: plan_traced(
            traced,
            mesh,
            global_batch=case["global_batch"],
            traced_batch=best["microbatch"],
            name=case["model"],
        )
    )
    entry["example_batch"] = best["microbatch"]
    case["autopar_at_baseline_batch"] = entry


def cases(quick: bool, full: bool) -> list[tuple[str, int]]:
    if quick:
        return list(QUICK_CASES)
    if full:
        return [(m, d) for m in MODELS for d in MESHES]
    return list(DEFAULT_CASES)


def parse_case(text: str) -> tuple[str, int]:
    """``gpt3-13b@64`` as (model, devices); ``ValueError`` saying what is wrong."""
    model, _, devices = text.partition("@")
    if model not in GLOBAL_BATCH or not devices.isdigit():
        raise ValueError(
            f"case {text!r}: write MODEL@DEVICES with a model of {', '.join(GLOBAL_BATCH)} "
            "and a device count such as 64"
        )
    count = int(devices)
    if count < 1 or (count > GPUS_PER_NODE and count % GPUS_PER_NODE):
        raise ValueError(
            f"case {text!r}: {count} devices are no cluster of {GPUS_PER_NODE}-GPU nodes; "
            f"use up to {GPUS_PER_NODE}, or a multiple of {GPUS_PER_NODE}"
        )
    return model, count


def run(
    quick: bool = False,
    full: bool = False,
    extra: list[tuple[str, int]] | None = None,
    done: dict[str, Any] | None = None,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every case of the run (``cases``), then those of ``extra`` it does not have; ``done``
    holds cases already measured (by key) that are kept as they are; ``save`` gets the
    record so far after each case (a long run can be resumed)."""
    start = time.perf_counter()
    results = []
    planned = cases(quick, full)
    for model, devices in [*planned, *(c for c in extra or () if c not in planned)]:
        key = f"{model}@{devices}"
        if done and key in done:
            diagnose(done[key])  # cases measured before the diagnosis existed
            results.append(done[key] | {"kept": True})
        else:
            results.append(run_case(model, devices))
        if save is not None:
            save({"cases": results, "seconds": time.perf_counter() - start})
    return {"cases": results, "seconds": time.perf_counter() - start}


def previous_summary(record: dict[str, Any]) -> dict[str, Any]:
    """What a new quality record keeps of the one it replaces, so the document can say
    what changed: when and at which commit it was run, and autopar's plan per case."""
    return {
        "date": record.get("date"),
        "commit": record.get("machine", {}).get("commit"),
        "cases": {
            f"{case['model']}@{case['devices']}": case["autopar"]
            for case in record["data"]["cases"]
        },
    }
