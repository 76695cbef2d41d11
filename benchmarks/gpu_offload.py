"""GPU check of offload (issue 25): a step with the optimizer on the host against the plan's
prediction and against no offload, and the host link measured (under 5 min).

    python benchmarks/gpu_offload.py [--out DIR] [--preset h100-sxm] [--cpu --small]

On one CUDA device, gpt3-1.3b (8 sequences of 2048), bf16 mixed precision, AdamW:

1. the host link: pinned copies to the device and back (``measure_host_copies``) and the
   host's AdamW step rate (``measure_host_step``), the figures ``autopar calibrate``
   writes into a preset's ``host``;
2. ``autopar.compile`` on a mesh of 1 without offload and with ``offload="optimizer"``:
   median step time of ``--steps`` after 3 warm-up steps, peak device memory, the bytes
   the step copied over the host link (``CompiledModel.host_log``) against the plan's
   ``Estimate.host``, and the plan's step time, under the preset and under one whose host
   figures are those measured in 1.

Writes ``DIR/gpu_offload.json`` and prints markdown rows for BENCHMARKS.md. ``--cpu --small``
runs the same code on CPU with a tiny model, to check the script where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

import autopar
from autopar_cost_model.calibrate import QUICK, measure_host_copies, measure_host_step
from autopar_cost_model.hardware import load_preset
from autopar_examples.models import build
from autopar_plans.writes import write_atomic
from benchmarks.gpu import start_one_process, step_times


def compiled_step(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    preset: str,
    offload: str,
    steps: int,
) -> dict[str, Any]:
    """One compiled model's measured step next to its plan's figures."""
    mesh = autopar.Mesh((1,), ("x",), device=preset)
    compiled = autopar.compile(
        model, mesh, example_inputs=(tokens,), precision="bf16_mixed", offload=offload
    )
    seconds, peak, resident = step_times(compiled, tokens, targets, device, steps)
    compiled.host_log.reset()
    step_times(compiled, tokens, targets, device, 1, warmup=0)  # one step's copies
    e = compiled.plan.estimate
    return {
        "offload": compiled.plan.offload.model_dump(),
        "step_s": seconds,
        "peak_bytes": peak,
        "resident_bytes": resident,
        "planned_step_s": e.step_time_s,
        "planned_optimizer_s": e.optimizer_s,
        "planned_offload_s": e.offload_s,
        "planned_memory_bytes": e.memory_per_device_bytes.total,
        "planned_host_bytes": e.memory_per_device_bytes.host,
        "copied": {f"{d}/{p}": n for (d, p), n in compiled.host_log.nbytes.items()},
        "planned_copies": {f"{c.direction}/{c.purpose}": c.bytes for c in e.host},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--preset", default="h100-sxm")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--small", action="store_true", help="a tiny GPT (checks the script)")
    args = parser.parse_args()
    device = start_one_process(args.cpu)
    preset = "cpu" if args.cpu else args.preset
    report: dict[str, Any] = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(0)}
    if device.type == "cuda":
        to_device, from_device = measure_host_copies(device, QUICK)
        report["host_link"] = {"to_device": to_device, "from_device": from_device}
    report["host_adamw_bytes_per_s"] = measure_host_step(QUICK)
    host = load_preset(preset).host
    report["preset_host"] = host.model_dump() if host is not None else None

    name = "gpt-tiny" if args.small else "gpt3-1.3b"
    runs = {}
    for offload in ("none", "optimizer"):
        torch.manual_seed(0)
        model, (tokens,) = build(name, batch_size=args.batch)
        model = model.to(device)
        tokens = torch.randint(0, model.wte.weight.shape[0], tokens.shape, device=device)
        targets = torch.roll(tokens, -1, dims=1)
        start = time.perf_counter()
        runs[offload] = compiled_step(model, tokens, targets, device, preset, offload, args.steps)
        runs[offload]["wall_s"] = time.perf_counter() - start
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["runs"] = runs
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "gpu_offload.json", json.dumps(report, indent=2, sort_keys=True))
    print("| offload | step (ms) | planned (ms) | peak memory | planned memory | host |")
    print("|---|---:|---:|---:|---:|---:|")
    for offload, run in runs.items():
        print(
            f"| {offload} | {run['step_s'] * 1e3:.1f} | {run['planned_step_s'] * 1e3:.1f} "
            f"| {run['peak_bytes'] / 2**30:.2f} GiB | {run['planned_memory_bytes'] / 2**30:.2f} "
            f"GiB | {run['planned_host_bytes'] / 2**30:.2f} GiB |"
        )
    if "host_link" in report:
        link = report["host_link"]
        print(
            f"host link: {link['to_device'] / 1e9:.1f} GB/s to the device, "
            f"{link['from_device'] / 1e9:.1f} GB/s back"
        )
    print(f"host AdamW step: {report['host_adamw_bytes_per_s'] / 1e9:.1f} GB/s of its traffic")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
