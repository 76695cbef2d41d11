"""Communication policies: what compression sends and saves on a cluster, and local SGD
against a straggler on real ranks.

    python -m benchmarks --only communication [--quick]

**Compression, planned.** A Llama-style decoder (Llama-3-8B's width and vocabulary, 8
layers: 2.8B parameters, its loss inside) planned data parallel (``force="dp"``, no ZeRO,
no pipeline) on 16 nodes of 8 H100s, bf16 mixed precision, one 2048-token sequence per
device: a communication-bound case, where each step's compute is short next to the sum of
5.6 GB of gradients. Planned once per policy (``grad_compression=``, ``sync=``), each
row is the plan's own estimate: the gradient sum's bytes sent per device per step (the
ledger's), its time and the part backward does not hide, the step time, and the state the
scheme keeps. Estimates, not measurements (no GPU cluster here).

How to read it. Under bf16 mixed precision the gradients already cross in bf16, so the
bf16 scheme changes nothing. TernGrad sums its levels as integers in an all-reduce: int8
holds a sum over at most 127 devices, and neither gloo nor NCCL sums int16, so on 128
devices the levels travel as int32, more bytes than bf16 gradients. Top-k and block top-k
all-gather every device's picks: the gathered buffer grows with the device count (1% of
the values from each of 128 devices is more than the whole gradient), which is why sparse
all-gathers pay on a few devices and not on many. PowerSGD's factors are tiny; what is left
of its time is the encoding's passes over the gradients (priced as memory traffic) and the
vectors it sends whole. Local SGD pays one averaging of the parameters every 4 steps. The
last row is the same plan with one all-reduce per mesh axis instead of the hierarchical
form: 8 times the bytes over the nodes.

**Straggler, measured.** gpt-tiny-sized Llama on 4 gloo ranks (a 2 x 2 mesh), data
parallel, SGD. One rank sleeps ``SLEEP`` seconds in a step, either always the same rank
(fixed) or each step the next rank (rotating). Synchronous data parallelism waits for the
slow rank every step; local SGD (``sync="local_sgd"``, ``period=4``) only at the averaging.
Time per block of 4 steps, barrier to barrier (the slowest rank's), median over rounds that
alternate the two policies.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.report.gradients import sync_entries
from autopar.testing.ranks import run_ranks
from benchmarks.common import build_with_loss

MODEL = {"name": "llama3-8b", "n_layer": 8, "seq_len": 2048}
QUICK_MODEL = {"name": "llama-tiny"}
NODES, GPUS = 16, 8
POLICIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("none", {}),
    ("bf16", {"grad_compression": "bf16"}),
    ("terngrad", {"grad_compression": "terngrad"}),
    ("topk 1%", {"grad_compression": {"scheme": "topk", "ratio": 0.01}}),
    ("block_topk 1%", {"grad_compression": {"scheme": "block_topk", "ratio": 0.01}}),
    ("powersgd r=4", {"grad_compression": {"scheme": "powersgd", "rank": 4}}),
    ("powersgd r=1", {"grad_compression": {"scheme": "powersgd", "rank": 1}}),
    ("local SGD H=4", {"sync": "local_sgd", "period": 4}),
    ("per-axis sums (no hierarchy)", {"reduction_form": "per_axis"}),
)
SLEEP = 0.05
BLOCK = 4  # steps per timed block: local SGD's period
ROUNDS = 6


def planned(quick: bool) -> list[dict[str, Any]]:
    """One plan per policy of the Llama-style model on the cluster."""
    spec = dict(QUICK_MODEL if quick else MODEL)
    name = spec.pop("name")
    devices = 4 if quick else NODES * GPUS
    model, inputs = build_with_loss(name, devices, **spec)
    mesh = (
        autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
        if quick
        else autopar.Mesh.cluster(nodes=NODES, gpus_per_node=GPUS, device="h100-sxm")
    )
    rows = []
    for label, options in POLICIES:
        plan = autopar.plan(
            model,
            mesh,
            inputs,
            force="dp",
            zero=0,
            stages=1,
            precision="fp32" if quick else "bf16_mixed",
            **options,
        )
        sync = sync_entries(plan.estimate.comm)
        rows.append(
            {
                "policy": label,
                "form": plan.grad_reduction.form,
                "sent_bytes": sum(e.sent_per_step for e in sync),
                "over_nodes_bytes": sum(
                    e.sent_per_step for e in sync if e.axes == (mesh.axis_names[0],)
                ),
                "sync_s": sum(e.time_s for e in sync),
                "exposed_s": sum(e.exposed_s for e in sync),
                "step_s": plan.estimate.step_time_s,
                "compute_s": plan.estimate.compute_s,
                "optimizer_gib": plan.estimate.memory_per_device_bytes.optimizer / 2**30,
                "parallelism": str(plan.parallelism),
            }
        )
    return rows


def _straggler_work(rank: int, world: int, steps: int, rounds: int) -> dict[str, Any]:
    """Per (mode, policy): the seconds of each block of ``steps`` steps."""
    model_name = "llama-tiny"
    torch.manual_seed(0)
    models = {}
    for policy, options in (("sync", {}), ("local SGD", {"sync": "local_sgd", "period": steps})):
        model, inputs = build_with_loss(model_name, 8, device="cpu")
        compiled = autopar.compile(
            model,
            autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"),
            example_inputs=inputs,
            force="dp",
            zero=0 if policy == "sync" else None,
            **options,
        )
        models[policy] = (compiled, torch.optim.SGD(compiled.parameters(), lr=0.01), inputs)
    found: dict[str, list[float]] = {}
    for round_ in range(rounds + 1):  # the first round warms up
        order = list(models) if round_ % 2 == 0 else list(models)[::-1]
        for mode in ("fixed", "rotating"):
            for policy in order:
                compiled, optimizer, inputs = models[policy]
                dist.barrier()
                start = time.perf_counter()
                for step in range(steps):
                    slow = 0 if mode == "fixed" else step % world
                    if rank == slow:
                        time.sleep(SLEEP)
                    optimizer.zero_grad()
                    compiled(*inputs).backward()
                    optimizer.step()
                dist.barrier()
                if round_:
                    found.setdefault(f"{mode}/{policy}", []).append(time.perf_counter() - start)
    return found


def straggler(quick: bool) -> dict[str, Any]:
    rounds = 2 if quick else ROUNDS
    per_rank = run_ranks(_straggler_work, 4, (BLOCK, rounds))
    blocks = per_rank[0]  # barrier to barrier: the same on every rank
    medians = {key: statistics.median(values) for key, values in blocks.items()}
    return {"sleep_s": SLEEP, "block": BLOCK, "rounds": rounds, "blocks": blocks, "median": medians}


def run(quick: bool = False) -> dict[str, Any]:
    start = time.perf_counter()
    data = {"planned": planned(quick), "straggler": straggler(quick)}
    data["seconds"] = time.perf_counter() - start
    data["model"] = QUICK_MODEL if quick else MODEL
    return data
