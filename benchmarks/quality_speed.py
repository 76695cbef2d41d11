"""autopar's own planning time on cases of the quality table, without the baselines.

    python -m benchmarks.quality_speed llama3-8b@64 llama3-70b@512

Each case as the quality section plans autopar (``benchmarks.common.plan_traced`` on the
cluster mesh, the global batch of ``benchmarks.quality``, the example batch of one sequence
per device, smaller microbatches traced again): one JSON line with the wall and CPU time
(trace included), the tracing time, the plan chosen and its estimated step. The quality
section itself also plans every baseline, hours on two cores; this is the planning-speed
figure of issue 26 alone.
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks.common import plan_traced
from benchmarks.quality import Traces, cluster, global_batch, parse_case


def plan_case(model: str, devices: int) -> dict[str, object]:
    batch = global_batch(model, devices)
    traces = Traces(model)
    mesh = cluster(devices)
    example = min(devices, batch)
    start, cpu = time.perf_counter(), time.process_time()
    traced = traces.get(example)
    plan = plan_traced(
        traced, mesh, global_batch=batch, traced_batch=example, name=model, retrace=traces.get
    )
    chosen = plan.parallelism
    return {
        "case": f"{model}@{devices}",
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
        "trace_s": round(traces.seconds, 1),
        "plan": f"dp {chosen.dp} tp {chosen.tp} pp {chosen.pp} zero {chosen.zero}, "
        f"{chosen.microbatches} microbatches",
        "step_s": plan.estimate.step_time_s,
        "solver": plan.solver.status,
    }


def main(cases: list[str]) -> None:
    for text in cases:
        model, devices = parse_case(text)
        print(json.dumps(plan_case(model, devices)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
