"""Check autopar's NCCL path on one CUDA device and print a short report.

    python tests/gpu/check_nccl.py [--preset h200-sxm] [--steps 10]

For when a GPU machine is lent (pytest never collects this file: see ``conftest.py``). On
one device it starts a 1-rank NCCL process group and checks, each on its own (a failure is
reported and the rest still run):

1. the runtime's collectives on NCCL (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
   ``all_to_all``, ``all_reduce``) and their backward, on a 1-rank group: each is the
   identity there, so values and gradients are known exactly;
2. GPT-tiny and a bigger GPT (4 layers, d_model 512) compiled on a (1,) mesh with a GPU
   preset: 3 AdamW steps in fp32 (TF32 off) next to the eager model, losses equal to
   rtol 1e-4;
3. ``precision="bf16_mixed"`` next to the eager model under the same autocast (rtol 2e-2);
4. a GPT of odd vocabulary (1001) in ``bf16_mixed``: its lm_head runs padded on CUDA
   (``autopar_passes.rewrites.aligned_linear``; not on CPU), losses as eager's (rtol 2e-2);
5. a sharded checkpoint (DCP) saved and loaded back into a fresh compiled model;
6. for the bigger GPT, eager against compiled: median step time of ``--steps`` steps
   (after 3 warm-up steps) and peak memory (``torch.cuda.max_memory_allocated``) of each.

Exit status 0 when every check passes. ``--cpu`` runs the same on CPU with gloo (no timing
meaning, no memory figures), to check the script itself where no GPU is.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.runtime.collectives import AllGather, AllReduce, AllToAll, ReduceScatter
from autopar.runtime.comm import AxisGroup, CommLog
from autopar_examples.models import build, gpt
from autopar_passes.rewrites.aligned_linear import aligned_linear

BIG = {"vocab_size": 8192, "seq_len": 256, "n_layer": 4, "n_head": 8, "d_model": 512}


class Run:
    """Where the checks run: one CUDA device with NCCL, or the CPU with gloo (``--cpu``)."""

    def __init__(self, cpu: bool, preset: str) -> None:
        self.cpu = cpu
        self.device = torch.device("cpu") if cpu else torch.device("cuda", 0)
        self.preset = "cpu" if cpu else preset
        self.results: list[tuple[str, bool, str]] = []

    def start(self) -> None:
        if not self.cpu:
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the checks
            torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group(
            "gloo" if self.cpu else "nccl",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=None if self.cpu else self.device,
        )

    def mesh(self) -> autopar.Mesh:
        return autopar.Mesh((1,), ("dp",), device=self.preset)

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()

    def check(self, name: str, body: Callable[[], str]) -> None:
        """Run one check; record PASS with its detail line, or FAIL with the traceback."""
        try:
            detail = body()
            self.results.append((name, True, detail))
        except Exception:  # a report tool: record the failure, run the other checks
            self.results.append((name, False, traceback.format_exc()))
        print(("PASS  " if self.results[-1][1] else "FAIL  ") + name, flush=True)


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def case(
    run: Run, big: bool, seed: int = 0, vocab_size: int | None = None
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A GPT built on the CPU from ``seed`` and moved to the device, a batch and targets."""
    torch.manual_seed(seed)
    if big:
        vocab = vocab_size or BIG["vocab_size"]
        model, (idx,) = gpt(**(BIG | {"vocab_size": vocab}), batch_size=8)
    else:
        model, (idx,) = build("gpt-tiny", batch_size=4)
        vocab = 64
    generator = torch.Generator().manual_seed(1)
    target = torch.randint(0, vocab, idx.shape, generator=generator)
    return model.to(run.device), idx.to(run.device), target.to(run.device)


def free(run: Run) -> None:
    """Collect garbage (fx graphs hold reference cycles) and return cached device memory."""
    gc.collect()
    if not run.cpu:
        torch.cuda.empty_cache()


def train(
    model: nn.Module, idx: torch.Tensor, target: torch.Tensor, steps: int, dtype: Any = None
) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        if dtype is None:
            loss = loss_of(model(idx), target)
        else:
            with torch.autocast(idx.device.type, dtype=dtype):
                loss = loss_of(model(idx), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def compare(got: list[float], want: list[float], rtol: float) -> str:
    for g, w in zip(got, want, strict=True):
        if abs(g - w) > rtol * abs(w):
            raise AssertionError(f"losses differ beyond rtol {rtol}: {got} vs {want}")
    return "losses " + ", ".join(f"{g:.5f}/{w:.5f}" for g, w in zip(got, want, strict=True))


# ---- the checks -------------------------------------------------------------------------
def check_collectives(run: Run) -> str:
    group = AxisGroup(dist.new_group([0]), ("dp",), CommLog())
    backend = dist.get_backend(group.pg)
    for dim in range(3):
        x = torch.randn(4, 6, 8, device=run.device, requires_grad=True)
        for module, args in (
            (AllGather(group, "dp"), (dim,)),
            (ReduceScatter(group, "dp"), (dim,)),
            (AllReduce(group, "dp"), ()),
            (AllToAll(group, "dp"), (dim, (dim + 1) % 3)),
        ):
            x.grad = None
            y = module(x, *args)
            assert torch.equal(y, x), f"{type(module).__name__}(dim={dim}) changed values"
            y.sum().backward()
            assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))
    run.sync()
    return f"backend {backend}: all_gather, reduce_scatter, all_reduce, all_to_all, dims 0-2"


def check_equivalence(run: Run, big: bool, precision: str = "fp32") -> str:
    model, idx, target = case(run, big)
    reference = copy.deepcopy(model)
    compiled = autopar.compile(model, run.mesh(), example_inputs=(idx,), precision=precision)
    dtype = torch.bfloat16 if precision == "bf16_mixed" else None
    losses = train(compiled, idx, target, 3)
    ref_losses = train(reference, idx, target, 3, dtype)
    dtypes = {p.dtype for p in compiled.parameters()}
    assert dtypes == {torch.float32}, f"parameters are {dtypes}"
    detail = compare(losses, ref_losses, 1e-4 if precision == "fp32" else 2e-2)
    return f"{compiled.plan.parallelism.model_dump()} {detail}"


def check_odd_vocabulary(run: Run) -> str:
    """The bigger GPT with a vocabulary of 1001 (odd, as GPT-2's 50257) in bf16_mixed: on
    CUDA the lm_head runs padded to 1008 rows (``autopar_passes.rewrites.aligned_linear``), and
    trains as the eager model does under the same autocast."""
    model, idx, target = case(run, big=True, vocab_size=1001)
    reference = copy.deepcopy(model)
    compiled = autopar.compile(model, run.mesh(), example_inputs=(idx,), precision="bf16_mixed")
    rewritten = sum(n.target is aligned_linear for n in compiled.program.graph.nodes)
    expected = "none" if run.cpu else "some"
    assert (rewritten > 0) == (not run.cpu), f"{rewritten} linears rewritten; {expected} expected"
    losses = train(compiled, idx, target, 3)
    ref_losses = train(reference, idx, target, 3, torch.bfloat16)
    return f"{rewritten} linears as aligned_linear; {compare(losses, ref_losses, 2e-2)}"


def check_checkpoint(run: Run) -> str:
    model, idx, _ = case(run, big=False)
    compiled = autopar.compile(model, run.mesh(), example_inputs=(idx,))
    fresh_model, _, _ = case(run, big=False, seed=1)
    fresh = autopar.compile(fresh_model, run.mesh(), example_inputs=(idx,))
    with tempfile.TemporaryDirectory() as path:
        compiled.save_checkpoint(path)
        fresh.load_checkpoint(path)
    for name, _ in compiled.named_parameters():
        assert torch.equal(fresh.full_parameter(name), compiled.full_parameter(name)), name
    return "saved and loaded back: parameters equal"


def measure(run: Run, make: Callable[[], nn.Module], steps: int) -> tuple[float, float]:
    """Median step time (s) and peak memory (bytes) of a model made by ``make`` alone."""
    free(run)
    _, idx, target = case(run, big=True)
    model = make()
    free(run)  # what building left behind (a compiled model's source) is not its memory
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if not run.cpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(3 + steps):
        run.sync()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_of(model(idx), target).backward()
        optimizer.step()
        run.sync()
        if step >= 3:
            times.append(time.perf_counter() - start)
    peak = 0.0 if run.cpu else float(torch.cuda.max_memory_allocated())
    del model, optimizer
    return statistics.median(times), peak


def check_speed(run: Run, steps: int) -> str:
    def eager() -> nn.Module:
        return case(run, big=True)[0]

    def compiled() -> nn.Module:
        source, idx, _ = case(run, big=True)
        return autopar.compile(source, run.mesh(), example_inputs=(idx,))  # source is dropped

    eager_s, eager_peak = measure(run, eager, steps)
    compiled_s, compiled_peak = measure(run, compiled, steps)
    gib = 2**30
    return (
        f"median of {steps} steps: eager {eager_s * 1e3:.2f} ms, compiled "
        f"{compiled_s * 1e3:.2f} ms ({compiled_s / eager_s:.2f}x); peak memory: eager "
        f"{eager_peak / gib:.3f} GiB, compiled {compiled_peak / gib:.3f} GiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h200-sxm", help="GPU preset of the mesh")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--cpu", action="store_true", help="run on CPU with gloo")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device here; run with --cpu to check the script on CPU")
        return 2
    run = Run(args.cpu, args.preset)
    run.start()
    where = "CPU (gloo)" if run.cpu else f"{torch.cuda.get_device_name(0)} (NCCL)"
    version = None if run.cpu else torch.cuda.nccl.version()  # a tuple, an int in old torch
    nccl = (
        ""
        if version is None
        else f", NCCL {'.'.join(map(str, version)) if isinstance(version, tuple) else version}"
    )
    print(f"autopar check on {where}: torch {torch.__version__}{nccl}, preset {run.preset}")
    run.check("collectives on a 1-rank group", lambda: check_collectives(run))
    run.check("gpt-tiny fp32, 3 steps", lambda: check_equivalence(run, big=False))
    big = ", ".join(f"{k}={v}" for k, v in BIG.items())
    run.check(f"gpt ({big}) fp32, 3 steps", lambda: check_equivalence(run, big=True))
    run.check(
        "gpt-tiny bf16_mixed, 3 steps",
        lambda: check_equivalence(run, big=False, precision="bf16_mixed"),
    )
    run.check("gpt, vocabulary 1001, bf16_mixed, 3 steps", lambda: check_odd_vocabulary(run))
    run.check("sharded checkpoint (DCP)", lambda: check_checkpoint(run))
    run.check("eager vs compiled, bigger gpt", lambda: check_speed(run, args.steps))
    print("\nreport")
    for name, ok, detail in run.results:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
        print("        " + detail.rstrip().replace("\n", "\n        "))
    free(run)  # models gone before the process group (gloo aborts freeing them at exit)
    dist.destroy_process_group()
    return 0 if all(ok for _, ok, _ in run.results) else 1


if __name__ == "__main__":
    sys.exit(main())
