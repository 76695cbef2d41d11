"""GPU benchmark: eager against compiled, and the cost model against the GPU (under 5 min).

    python benchmarks/gpu.py [--out DIR] [--preset h200-sxm] [--cpu --small]

On one CUDA device, for a GPT of about 1.3B parameters (the gpt3-1.3b preset) in bf16
mixed precision (autocast; fp32 master weights, AdamW):

1. eager and ``autopar.compile`` on a mesh of 1 (NCCL): median step time of 10 steps after
   3 warm-up steps, and peak memory (``torch.cuda.max_memory_allocated``), each alone; then
   both held at once, step time in alternating pairs (the ratio the target is judged on);
2. the main ops of the traced graph (matmuls, attention, norms, pointwise), each timed alone
   on the GPU as the compiled program runs it (forward, median of 20), next to the cost
   model's prediction for the preset and for a preset calibrated on this GPU;
3. ``autopar calibrate``'s preset for this GPU, written to ``DIR/calibrated.yaml``;
4. where the time goes: two steps of each model under ``torch.profiler``, GPU kernel time
   by kernel and ATen calls by op, so a gap between the two has its cause in the record.

Writes ``DIR/gpu.json`` and prints markdown tables for BENCHMARKS.md. ``--cpu --small`` runs
the same code on CPU with a tiny model, to check the script where no GPU is.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.testing.ranks import free_port
from autopar_cost_model.compute import op_time
from autopar_cost_model.hardware import DevicePreset, load_preset
from autopar_examples.models import build
from autopar_passes.annotation import META_KEY
from autopar_passes.rewrites.aligned_linear import aligned_linear
from autopar_passes.trace import trace
from autopar_plans.writes import write_atomic
from benchmarks.render import profile_table

aten = torch.ops.aten

TIMED_OPS = (
    "aten.linear.default",
    "aten.einsum.default",
    "aten.scaled_dot_product_attention.default",
    "aten.layer_norm.default",
    "aten.gelu.default",
    "aten.add.Tensor",
    "aten.embedding.default",
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_times(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    steps: int,
    warmup: int = 3,
) -> tuple[float, float, float]:
    """Median seconds per training step (bf16 autocast, AdamW), peak bytes, and bytes
    allocated before the first step (what the model holds: a peak's resident part)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    resident = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        one_step(model, optimizer, tokens, targets, device)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return statistics.median(times), float(peak), float(resident)


def side_by_side(
    eager: torch.nn.Module,
    compiled: torch.nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    rounds: int = 5,
) -> dict[str, float]:
    """Step times of the two models in alternating pairs, both held at once: a clock or
    allocator drift between two runs one after the other cannot pass for overhead."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (eager, compiled)]
    times: list[list[float]] = [[], []]
    for i in range(rounds + 1):
        for which, model in enumerate((eager, compiled)):
            for _ in range(2):
                synchronize(device)
                start = time.perf_counter()
                one_step(model, optimizers[which], tokens, targets, device)
                synchronize(device)
                if i > 0:  # the first round warms both up
                    times[which].append(time.perf_counter() - start)
    eager_s, compiled_s = (statistics.median(t) for t in times)
    return {"eager_s": eager_s, "compiled_s": compiled_s, "ratio": compiled_s / eager_s}


def memory_limited(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    mesh: autopar.Mesh,
    limit: float,
    steps: int,
) -> dict[str, Any]:
    """The model compiled under a per-device memory ``limit`` (bytes) that only
    recomputation meets on one device: what the plan recomputes and predicts, and what the
    step measures. ``peak_bytes`` counts from what was allocated before compiling (the
    model given here and earlier runs' leftovers are not the compiled model's)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    compiled = autopar.compile(
        copy.deepcopy(model),
        mesh,
        example_inputs=(tokens,),
        precision="bf16_mixed",
        memory_limit=f"{int(limit)}B",
    )
    seconds, peak, _ = step_times(compiled, tokens, targets, device, steps)
    plan = compiled.plan
    return {
        "limit_bytes": limit,
        "planned_bytes": plan.estimate.memory_per_device_bytes.total,
        "recomputed_regions": len(plan.recompute),
        "recomputed_layers": sorted({layer for r in plan.recompute for layer in r.layers}),
        "predicted_s": plan.estimate.step_time_s,
        "step_s": seconds,
        "peak_bytes": max(peak - before, 0.0),
    }


def one_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
) -> None:
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()


def profile_steps(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    steps: int = 2,
) -> dict[str, Any]:
    """Per step: wall seconds, GPU kernel seconds by kernel name, and ATen calls by op
    (count, self CPU seconds), from ``torch.profiler`` after two warm-up steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        one_step(model, optimizer, tokens, targets, device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            one_step(model, optimizer, tokens, targets, device)
        synchronize(device)
    wall = (time.perf_counter() - start) / steps
    kernels: dict[str, float] = {}
    ops: dict[str, list[float]] = {}
    for event in prof.key_averages():
        if event.device_type == DeviceType.CUDA and event.self_device_time_total > 0:
            kernels[event.key] = event.self_device_time_total / 1e6 / steps
        elif event.key.startswith("aten::"):
            ops[event.key] = [event.count / steps, event.self_cpu_time_total / 1e6 / steps]
    return {"wall_s": wall, "kernel_s": sum(kernels.values()), "kernels": kernels, "ops": ops}


def time_op(node: torch.fx.Node, device: torch.device, repeat: int = 20) -> float:
    """Median forward seconds of one traced op on real bf16 tensors of its shapes, run as
    the compiled program runs it (``aten.linear`` as ``aligned_linear``)."""

    def real(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                dtype = torch.bfloat16 if val.is_floating_point() else val.dtype
                if val.is_floating_point():
                    return torch.randn(tuple(val.shape), dtype=dtype, device=device)
                return torch.zeros(tuple(val.shape), dtype=dtype, device=device)
            return val
        if isinstance(value, list | tuple):
            return type(value)(real(v) for v in value)
        return value

    args = real(node.args)
    kwargs = {k: real(v) for k, v in node.kwargs.items()}
    # as a compiled program on CUDA runs it: a 16-bit linear with unaligned rows padded
    target = aligned_linear if node.target is aten.linear.default else node.target
    for _ in range(3):
        target(*args, **kwargs)
    samples = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        target(*args, **kwargs)
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def op_table(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    device: torch.device,
    presets: dict[str, DevicePreset],
) -> list[dict[str, Any]]:
    traced = trace(copy.deepcopy(model).to("meta"), (tokens.to("meta"),))
    seen: set[tuple[str, str]] = set()
    rows = []
    for node in traced.graph.nodes:
        note = node.meta[META_KEY]
        if note.op not in TIMED_OPS or note.kind != "op":
            continue
        key = (note.op, str(note.outputs))
        if key in seen:
            continue
        seen.add(key)
        measured = time_op(node, device)
        row: dict[str, Any] = {
            "op": note.op.removeprefix("aten.").removesuffix(".default"),
            "shape": "x".join(map(str, note.outputs[0].shape)),
            "measured_s": measured,
        }
        for label, preset in presets.items():
            # activations were traced in fp32; the step runs them in bf16: half the bytes
            row[f"predicted_{label}_s"] = op_time(
                note.fwd_flops, (note.bytes_read + note.bytes_written) / 2, "bfloat16", preset
            )
        rows.append(row)
    return rows


def start_one_process(cpu: bool) -> torch.device:
    """The device of a one-process benchmark (the first GPU, or the CPU) with its process
    group of one (NCCL, or gloo), as ``autopar.compile`` on a mesh of 1 needs."""
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    return device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--preset", default="h200-sxm")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--small", action="store_true", help="a tiny GPT (checks the script)")
    args = parser.parse_args()
    device = start_one_process(args.cpu)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if not args.cpu else "cpu"}

    from autopar_cost_model.calibrate import calibrate

    calibrated = calibrate(name="calibrated", quick=True).preset
    args.out.mkdir(parents=True, exist_ok=True)
    from autopar_cost_model.hardware import dump_preset

    write_atomic(args.out / "calibrated.yaml", dump_preset(calibrated))
    presets = {
        "preset": load_preset(args.preset if not args.cpu else "cpu"),
        "calibrated": calibrated,
    }

    name, overrides = ("gpt-tiny", {}) if args.small else ("gpt3-1.3b", {})
    torch.manual_seed(0)
    model, (tokens,) = build(name, batch_size=args.batch, **overrides)
    model = model.to(device)
    tokens = torch.randint(0, model.wte.weight.shape[0], tokens.shape, device=device)
    targets = torch.roll(tokens, -1, dims=1)
    report["model"] = {
        "preset": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": list(tokens.shape),
    }

    eager_time, eager_peak, eager_resident = step_times(
        copy.deepcopy(model), tokens, targets, device, args.steps
    )
    mesh = autopar.Mesh((1,), ("x",), device=presets["preset"].name)
    start = time.perf_counter()
    compiled = autopar.compile(
        copy.deepcopy(model), mesh, example_inputs=(tokens,), precision="bf16_mixed"
    )
    report["compile_s"] = time.perf_counter() - start
    # runs from here on have the q/k/v projection as one matmul
    # (``autopar_passes.rewrites.fused_projection``)
    report["fused_projection"] = True
    # and the model given to compile is freed when it returns (``autopar.api._build``)
    report["frees_given_model"] = True
    # and a 16-bit linear with unaligned rows (the lm_head of 50257) runs padded
    report["aligned_linear"] = True
    compiled_time, compiled_peak, compiled_resident = step_times(
        compiled, tokens, targets, device, args.steps
    )
    report["step"] = {
        "eager_s": eager_time,
        "compiled_s": compiled_time,
        "ratio": compiled_time / eager_time,
        "eager_peak_bytes": eager_peak,
        "compiled_peak_bytes": compiled_peak,
        # allocated before the first step, the original model included in both: tells a
        # peak gap held by the module from one made during the step
        "eager_resident_bytes": eager_resident,
        "compiled_resident_bytes": compiled_resident,
        "predicted_s": compiled.plan.estimate.step_time_s,
    }
    try:
        report["side_by_side"] = side_by_side(
            copy.deepcopy(model), compiled, tokens, targets, device
        )
    except torch.OutOfMemoryError:  # both models at once need twice the weights and state
        report["side_by_side"] = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report["profile"] = {
        "eager": profile_steps(copy.deepcopy(model), tokens, targets, device),
        "compiled": profile_steps(compiled, tokens, targets, device),
    }
    report["ops"] = op_table(model, tokens, device, presets)
    # two thirds of the memory the unlimited plan needs: recomputation has to make it fit
    unlimited = compiled.plan.estimate.memory_per_device_bytes.total
    del compiled
    report["memory_limited"] = memory_limited(
        model, tokens, targets, device, mesh, 2 / 3 * unlimited, args.steps
    ) | {"unlimited_planned_bytes": unlimited}
    write_atomic(args.out / "gpu.json", json.dumps(report, indent=2))

    print(
        f"# {report['device']}: {name}, {report['model']['parameters'] / 1e9:.2f}B "
        f"parameters, batch {tuple(tokens.shape)}, bf16 mixed precision\n"
    )
    s = report["step"]
    print("| | eager | autopar (mesh of 1) | ratio |\n|---|---:|---:|---:|")
    print(
        f"| step time (median of {args.steps}) | {s['eager_s'] * 1e3:.1f} ms | "
        f"{s['compiled_s'] * 1e3:.1f} ms | {s['ratio']:.3f} |"
    )
    pair = report["side_by_side"]
    if pair is not None:
        print(
            f"| step time, alternating pairs | {pair['eager_s'] * 1e3:.1f} ms | "
            f"{pair['compiled_s'] * 1e3:.1f} ms | {pair['ratio']:.3f} |"
        )
    print(
        f"| peak memory | {s['eager_peak_bytes'] / 2**30:.2f} GiB | "
        f"{s['compiled_peak_bytes'] / 2**30:.2f} GiB | "
        f"{s['compiled_peak_bytes'] / max(s['eager_peak_bytes'], 1):.3f} |"
    )
    print(
        f"| allocated before the first step | {s['eager_resident_bytes'] / 2**30:.2f} GiB | "
        f"{s['compiled_resident_bytes'] / 2**30:.2f} GiB | "
        f"{s['compiled_resident_bytes'] / max(s['eager_resident_bytes'], 1):.3f} |"
    )
    print(
        f"\nplanned step time {s['predicted_s'] * 1e3:.1f} ms; compile (trace + plan + "
        f"lower) {report['compile_s']:.1f} s\n"
    )
    print(
        "| op | output | measured | predicted (preset) | ratio | predicted (calibrated) | "
        "ratio |\n|---|---|---:|---:|---:|---:|---:|"
    )
    for row in report["ops"]:
        m, p, c = row["measured_s"], row["predicted_preset_s"], row["predicted_calibrated_s"]
        print(
            f"| {row['op']} | {row['shape']} | {m * 1e6:.1f} us | {p * 1e6:.1f} us | "
            f"{m / p:.2f} | {c * 1e6:.1f} us | {m / c:.2f} |"
        )
    limited = report["memory_limited"]
    print(
        f"\nUnder a memory limit of {limited['limit_bytes'] / 2**30:.2f} GiB (two thirds of "
        f"the unlimited plan's {limited['unlimited_planned_bytes'] / 2**30:.2f} GiB): "
        f"{limited['recomputed_regions']} regions recomputed; planned "
        f"{limited['planned_bytes'] / 2**30:.2f} GiB, {limited['predicted_s'] * 1e3:.1f} ms; "
        f"measured peak {limited['peak_bytes'] / 2**30:.2f} GiB, step "
        f"{limited['step_s'] * 1e3:.1f} ms (median of {args.steps})"
    )
    print("\nWhere the time goes (torch.profiler, two steps of each):\n")
    print("\n".join(profile_table(report["profile"])))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
