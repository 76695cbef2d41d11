"""What the benchmark sections share: the machine, models with their loss, planning a traced model.

Every section plans models built on ``meta`` (no weights) with the loss inside the graph
(``WithLoss``): a training step ends in a scalar, so no plan pays for gathering the logits
to every device, as DDP, FSDP and Megatron do not either.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.force import style_constraints
from autopar.hints_api import apply_hints
from autopar.options import PlanOptions
from autopar_examples.models import build
from autopar_passes.pipeline.search import PipelineRequest, plan_pipeline
from autopar_passes.solve import Constraints, SolveRequest, no_constraints
from autopar_passes.trace import TracedModel, trace
from autopar_plans.mesh import MeshSpec
from autopar_plans.plan import Plan
from autopar_plans.units import parse_bytes

PRESET = "h100-sxm"
PRECISION = "bf16_mixed"
MEMORY_LIMIT = "80GiB"


def machine() -> dict[str, Any]:
    """Where the figures were measured: CPU model, cores, memory, Python and torch."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(_memory_bytes() / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": _commit(),
    }


def describe_machine(info: dict[str, Any]) -> str:
    """``Intel Xeon ..., 2 cores, 23.4 GiB, Linux 6.1, Python 3.11.2, torch 2.13.0+cpu``."""
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, {info['os']}, "
        f"Python {info['python']}, torch {info['torch']}"
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _commit() -> str:
    """The commit checked out, ``+ uncommitted changes`` when tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = head.stdout.strip() or "unknown"
    return commit + (" + uncommitted changes" if dirty.returncode == 1 else "")


class WithLoss(nn.Module):
    """``model`` followed by its training loss: mean token cross-entropy (plus a mixture of
    experts' balancing loss when the model returns one)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = self.model(idx)  # (B, T, V), or ((B, T, V), aux) for a mixture of experts
        aux = None
        if isinstance(out, tuple):
            out, aux = out
        loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
        return loss if aux is None else loss + aux


def build_with_loss(
    name: str, batch: int, device: str = "meta", **overrides: Any
) -> tuple[WithLoss, tuple[torch.Tensor, torch.Tensor]]:
    """Preset ``name`` with its loss, and (tokens, targets) of ``batch`` sequences."""
    model, (tokens,) = build(name, device=device, batch_size=batch, **overrides)
    targets = tokens.clone() if device != "meta" else torch.empty_like(tokens)
    return WithLoss(model), (tokens, targets)


def trace_with_loss(name: str, batch: int, **overrides: Any) -> tuple[TracedModel, float]:
    """The traced preset with its loss, and the seconds tracing took."""
    model, inputs = build_with_loss(name, batch, **overrides)
    start = time.perf_counter()
    traced = trace(model, inputs)
    return traced, time.perf_counter() - start


# the models and device counts the benchmarks plan (speed; plan quality with --full)
MODELS = (
    "gpt2-124m",
    "gpt3-1.3b",
    "gpt3-6.7b",
    "gpt3-13b",
    "gpt3-175b",
    "llama3-8b",
    "llama3-70b",
    "mixtral-8x7b",
)
MESHES = (8, 64, 512, 1024)


def cluster(devices: int) -> autopar.Mesh:
    """``devices`` H100s as nodes of 8 (one node when fewer)."""
    per_node = min(devices, 8)
    return autopar.Mesh.cluster(nodes=devices // per_node, gpus_per_node=per_node, device=PRESET)


def plan_traced(
    traced: TracedModel,
    mesh: MeshSpec,
    *,
    global_batch: int,
    traced_batch: int,
    force: str | None = None,
    hints: dict[str, Any] | None = None,
    stages: int | None = None,
    zero: int | None = None,
    microbatches: int | None = None,
    name: str = "",
    time_limit: float = 60.0,
    retrace: Callable[[int], TracedModel] | None = None,
) -> Plan:
    """``autopar.plan`` on an already traced model: the same requests, the same search
    (``autopar.api._plan`` without its trace), so one trace serves many plans; ``retrace``
    gives the model traced at a smaller batch, as ``autopar.plan`` traces it (None: the
    search keeps to the sizes the given trace scales to). When nothing fits, the error is
    the search's own, not the hint that ``autopar.plan`` would blame."""
    options = PlanOptions(
        global_batch=global_batch,
        memory_limit=MEMORY_LIMIT,
        precision=PRECISION,
        force=force,
        zero=zero,
        stages=stages,
        microbatches=microbatches,
        time_limit=time_limit,
        hints=hints,
    )
    hinted = apply_hints(hints, traced, mesh, options)  # checks the hints against the model
    constraints: Constraints = partial(style_constraints, force) if force else no_constraints
    request = SolveRequest(
        mesh,
        float(parse_bytes(MEMORY_LIMIT)),
        options.optimizer,
        PRECISION,
        time_limit,
        constraints,
        zero_levels=(zero,) if zero is not None else (0, 1, 2),
    )
    pipeline = PipelineRequest(
        request,
        global_batch,
        traced_batch,
        name,
        stages if stages is not None or not force else 1,
        None,
        microbatches,
        None,
        retrace=retrace,
    )
    if hinted.resolved is None:
        return plan_pipeline(traced, pipeline)
    # the hints as constraints, as autopar.plan applies them, without its search for the
    # hints to blame when nothing fits (minutes on a big model; a baseline needs no culprit)
    return plan_pipeline(traced, hinted.resolved.apply(pipeline))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@contextmanager
def quiet_warnings() -> Iterator[None]:
    """Planner warnings (ops without a rule, a solver time-out) belong in the plans the
    sections record, not on the terminal of a long run."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
