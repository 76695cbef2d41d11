"""Megatron-LM's PTD-P configurations against autopar's search, costed by the same model.

    python -m benchmarks.ptdp [ROW ...]        (rows by size: 1.7b 18.4b 529.6b; default all)

Each row of Narayanan et al. 2021, Table 1: a GPT (vocabulary 51,200, sequence 2,048) on
A100 80 GB nodes of 8, the global batch as published, bf16 mixed precision, Adam. Planned
twice on the same cluster:

- **autopar**: ``autopar.plan`` from an example of one sequence (what a preset gives the
  CLI), the whole search (stages, schedules, microbatches, ZeRO, recomputation);
- **Megatron**: the published configuration forced: tensor parallelism of the published
  degree ``t`` inside the node (``force="tp"`` on the mesh ``nodes x 8/t x t``, ``"dp"``
  where ``t = 1``), the published pipeline stages, ZeRO 0 (the 2021 runs kept a whole
  optimizer per data-parallel rank), one sequence per data-parallel rank a microbatch.

and the step the paper measured: ``96 B s l h^2 (1 + s/6h + V/16lh)`` FLOPs (full
recomputation) at the published TFLOP/s per GPU. One JSON line per row: both estimates,
the plans, the planning times (wall, two cores here).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, NamedTuple

import autopar
from autopar.mesh import Mesh
from autopar_plans.plan import Plan
from benchmarks.common import build_with_loss

VOCAB, SEQ = 51200, 2048
DEVICE = "a100-80gb-sxm"


class Row(NamedTuple):
    """One row of Table 1 (Narayanan et al. 2021)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved per GPU, as published

    @property
    def nodes(self) -> int:
        return self.gpus // 8

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def measured_step_s(self) -> float:
        """The published step: its FLOPs with full recomputation at the published rate."""
        b, s, h, n, v = self.batch, SEQ, self.hidden, self.layers, VOCAB
        flops = 96 * b * s * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h))
        return flops / (self.gpus * self.tflops * 1e12)


ROWS = (
    Row("1.7b", 24, 2304, 24, 1, 1, 32, 512, 137),
    Row("3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("7.5b", 32, 4096, 36, 4, 1, 128, 512, 142),
    Row("18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row("76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row("310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row("529.6b", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row("1008b", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def model(row: Row, batch: int) -> tuple[Any, tuple[Any, ...]]:
    """The row's GPT with its loss inside (Megatron's vocabulary-parallel cross-entropy
    needs no whole logits; a model returning them would have every rank gather them)."""
    return build_with_loss(
        "gpt3-175b",
        batch,
        n_layer=row.layers,
        n_head=row.heads,
        d_model=row.hidden,
        vocab_size=VOCAB,
        seq_len=SEQ,
    )


def autopar_plan(row: Row) -> Plan:
    """autopar's own choice, from an example of one sequence."""
    net, inputs = model(row, 1)
    mesh = Mesh.cluster(row.nodes, 8, device=DEVICE)
    return autopar.plan(
        net, mesh, inputs, global_batch=row.batch, precision="bf16_mixed", name=row.name
    )


def megatron_plan(row: Row) -> Plan:
    """The published configuration, forced (module docstring)."""
    net, inputs = model(row, row.dp)
    if row.tp == 1:
        mesh = Mesh.cluster(row.nodes, 8, device=DEVICE)
    else:
        mesh = Mesh(
            (row.nodes, 8 // row.tp, row.tp),
            ("node", "dp", "tp"),
            device=DEVICE,
            gpus_per_node=8,
        )
    return autopar.plan(
        net,
        mesh,
        inputs,
        global_batch=row.batch,
        precision="bf16_mixed",
        force="tp" if row.tp > 1 else "dp",
        stages=row.pp,
        zero=0,
        microbatches=row.batch // row.dp,
        name=f"{row.name} (Megatron)",
    )


def _timed(make: Any, row: Row) -> tuple[Plan, float]:
    start = time.perf_counter()
    made = make(row)
    return made, time.perf_counter() - start


def _shape(plan: Plan) -> str:
    p = plan.parallelism
    return (
        f"dp {p.dp} tp {p.tp} sp {p.sp} pp {p.pp} zero {p.zero}, {p.microbatches} "
        f"microbatches of {plan.microbatch_size}"
    )


def compare(row: Row) -> dict[str, object]:
    ours, ours_s = _timed(autopar_plan, row)
    theirs, theirs_s = _timed(megatron_plan, row)
    return {
        "row": row.name,
        "cluster": f"{row.nodes}x8",
        "autopar_step_s": round(ours.estimate.step_time_s, 2),
        "megatron_forced_step_s": round(theirs.estimate.step_time_s, 2),
        "megatron_measured_step_s": round(row.measured_step_s(), 2),
        "autopar_plan": _shape(ours),
        "megatron_plan": _shape(theirs),
        "autopar_planning_s": round(ours_s, 1),
        "megatron_planning_s": round(theirs_s, 1),
    }


def main(names: list[str]) -> None:
    rows = [r for r in ROWS if not names or r.name in names]
    unknown = set(names) - {r.name for r in ROWS}
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; known: {[r.name for r in ROWS]}")
    for row in rows:
        print(json.dumps(compare(row)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
