"""Runtime on real ranks: autopar's compiled module against the PyTorch code for the same strategy.

    python -m benchmarks --only runtime [--quick]

On 4 CPU ranks (gloo, one thread each), a small Llama-style decoder (separate q, k, v
projections, so DTensor's tensor-parallel plan applies as torchtitan writes it) with its
loss inside the module trains with AdamW, ``foreach=True`` on every side (CUDA's default;
CPU's default, a loop over parameters, costs a compiled model's DTensor parameters a
dispatch per parameter and op: the ``dp`` optimizer step measured 27 ms against 11 ms
under DDP here).
Each strategy is set up twice on the same weights:

- ``dp``: ``autopar.compile(force="dp", zero=0)`` against ``DistributedDataParallel``;
- ``fsdp``: ``autopar.compile(force="fsdp")`` against FSDP2 (``fully_shard`` per block and
  the root);
- ``tp``: ``autopar.compile(force="tp")``, with a hint banning batch splits on the tp axis
  (``force="tp"`` alone lets the solver also split the batch there), against DTensor tensor
  parallelism (``parallelize_module``: vocab-split embedding, column-split q/k/v/gate/up
  and head, row-split o/down; norms replicated), every rank the whole batch;
- ``zero1``: ``autopar.compile(force="dp", zero=1)`` (optimizer state sharded) against DDP
  with ``ZeroRedundancyOptimizer`` (each rank steps the parameters it owns and broadcasts
  them);
- ``zero2``: ``autopar.compile(force="dp", zero=2)`` (gradients sharded too: reduce-scatter,
  and an all-gather of the stepped pieces) against FSDP2 with ``reshard_after_forward=False``
  (parameters gathered once per step, gradients reduce-scattered: ZeRO-2's traffic);
- ``pp``: ``autopar.compile(stages=4, schedule="1f1b", microbatches=4)`` with a loss
  function, stepped by ``train_step``, against ``torch.distributed.pipelining`` written by
  hand as torchtitan writes it: four stages of one block each (the embedding on the first,
  the norm and head on the last), ``Schedule1F1B`` over the same microbatches.

All twelve run in one job, one step of each in turn (so load from other processes falls on all
alike), after warm-up steps; every other round runs them in reverse order, so that no
variant always follows the same one. A step is ``zero_grad``, forward with loss, backward,
``optimizer.step()``, timed from a barrier to the end on every rank; the step's time is the
slowest rank's, and the figure the median over steps (the quartiles of the per-step ratios,
steps paired in the order they ran, show the noise). Bytes are what rank 0 wrote to its
sockets during the step (``wchar`` of ``/proc/self/io``: gloo sends over TCP with
``writev``), next to the plan's own estimate of bytes sent per device. gloo has no
reduce-scatter, so autopar runs an all-reduce there (``runtime.collectives``) and ZeRO
sends more than its plan's estimate, which counts a ring reduce-scatter; the PyTorch
baselines send as much (``ZeroRedundancyOptimizer`` all-reduces by design, and FSDP2's
reduce-scatter on gloo measures the same bytes).

On 1 rank (one process of one thread, as each of the 4 is): ``autopar.compile`` on a mesh
of one against the eager module, same model.

Each autopar row also gives the plan's predicted step time, next to the measured one, and
``auto`` is autopar's free choice (no style forced) on the same 4 ranks, given the loss as
``pp`` is (``loss_fn``, so that pipelines are among its choices) and stepped by
``train_step``, measured in the same rounds, against the fastest of the PyTorch setups.
Plans are made for a preset of this machine when it has one (``autopar calibrate --ranks
4 --name local-cpu-4`` for the 4 ranks, ``autopar calibrate --ranks 1 --name local-cpu-1``
for the one: a rank runs one thread), else the shipped ``cpu`` preset; the record says
which. The predicted step is meant to be within 25% of the measured (0.75 to 1.25).

The calibration measures what each of the 4 ranks gets while all 4 run on the 2 cores
(``autopar_cost_model.calibrate``), and fits ``in_step``, how much slower ops run inside a step
than alone, to a fixed reference step (``autopar_cost_model.reference_step``). A rank that waits
leaves its share of the cores to the others: a pipeline's ranks idle in its bubble, and the
busy ones run faster meanwhile. The preset records the sharing (``shared_cores``: 4 ranks
on 2 cores), and the cost model simulates a pipeline's schedule with it
(``autopar_cost_model.schedule``); on GPUs, a device each, it does not arise. The data-parallel
styles keep every rank busy.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
import types
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar_examples.models import build
from benchmarks.common import WithLoss

MODEL = dict(vocab_size=512, seq_len=128, n_layer=4, n_head=8, n_kv_head=4, d_model=256, d_ff=688)
QUICK_MODEL = dict(vocab_size=64, seq_len=16, n_layer=4, n_head=4, n_kv_head=4, d_model=32, d_ff=64)
BATCH = 8
LR = 1e-3
STRATEGIES = ("dp", "fsdp", "tp", "zero1", "zero2", "pp")
# the PyTorch code each strategy is measured against
BASELINE_NAMES = {
    "dp": "torch DDP",
    "fsdp": "torch FSDP2",
    "tp": "torch DTensor TP",
    "zero1": "torch DDP + ZeroRedundancyOptimizer",
    "zero2": "torch FSDP2 (no reshard)",
    "pp": "torch pipelining 1F1B",
}
PIPELINE = {"stages": 4, "schedule": "1f1b", "microbatches": 4}


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with its foreach kernels, on both sides: CUDA's default, and on CPU (whose default
    is a loop over parameters) the one that does not pay DTensor's dispatch per parameter.
    DTensors and plain tensors in separate groups, since one foreach kernel takes only one
    kind (DTensor tensor parallelism leaves the norms' weights plain)."""
    from torch.distributed.tensor import DTensor

    listed = list(params)
    groups = [
        {"params": [p for p in listed if isinstance(p, DTensor) == kind]} for kind in (True, False)
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, foreach=True)


def _preset(ranks: int) -> str:
    """This machine's preset for ``ranks`` one-thread ranks (``local-cpu-4``, ``local-cpu-1``:
    written by ``autopar calibrate --ranks``), else the shipped ``cpu``."""
    from autopar_cost_model.hardware import load_preset
    from autopar_plans.errors import AutoparError

    name = f"local-cpu-{ranks}"
    try:
        load_preset(name)
    except AutoparError:
        return "cpu"
    return name


def config(quick: bool) -> dict[str, Any]:
    return {
        "preset": _preset(4),
        "single_preset": _preset(1),
        "model": dict(QUICK_MODEL if quick else MODEL),
        "batch": 4 if quick else BATCH,
        "steps": 3 if quick else 40,
        "warmup": 1 if quick else 3,
        "world_size": 4,
    }


def _make_model(model_config: dict[str, Any], batch: int) -> tuple[WithLoss, tuple]:
    torch.manual_seed(0)
    model, (tokens,) = build("llama-tiny", batch_size=batch, **model_config)
    generator = torch.Generator().manual_seed(1)
    targets = torch.randint(0, model_config["vocab_size"], tokens.shape, generator=generator)
    return WithLoss(model), (tokens, targets)


def _wchar() -> int:
    """Bytes this process has written through write-like system calls (sockets included)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


class Variant:
    """One way to run the training step, and what was measured of it: ``run`` does the
    forward and backward of one step and returns the loss (None on a rank without it)."""

    def __init__(
        self,
        name: str,
        run: Callable[[], torch.Tensor | None],
        optimizer: torch.optim.Optimizer,
        plan: Any = None,
    ):
        self.name = name
        self.run = run
        self.optimizer = optimizer
        self.plan = plan
        self.times: list[float] = []
        self.bytes: list[int] = []
        self.losses: list[float] = []

    @classmethod
    def of_module(cls, name: str, module: nn.Module, inputs: tuple, **kwargs: Any) -> Variant:
        """A module whose forward returns the loss."""

        def run() -> torch.Tensor:
            loss = module(*inputs)
            loss.backward()
            return loss

        optimizer = kwargs.pop("optimizer", None) or adamw(module.parameters())
        return cls(name, run, optimizer, **kwargs)

    def step(self, record: bool) -> None:
        dist.barrier()
        written = _wchar()
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.run()
        self.optimizer.step()
        seconds = time.perf_counter() - start
        sent = _wchar() - written
        if record:
            self.times.append(seconds)
            self.bytes.append(sent)
            self.losses.append(float(loss.detach()) if loss is not None else float("nan"))


def _pytorch_dp(model: WithLoss, inputs: tuple, rank: int, world: int) -> Variant:
    from torch.nn.parallel import DistributedDataParallel

    local = tuple(x.chunk(world)[rank] for x in inputs)
    return Variant.of_module(BASELINE_NAMES["dp"], DistributedDataParallel(model), local)


def _pytorch_fsdp(
    model: WithLoss, inputs: tuple, rank: int, world: int, reshard: bool = True
) -> Variant:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    local = tuple(x.chunk(world)[rank] for x in inputs)
    return Variant.of_module(BASELINE_NAMES["fsdp" if reshard else "zero2"], model, local)


def _pytorch_zero1(model: WithLoss, inputs: tuple, rank: int, world: int) -> Variant:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, foreach=True
    )
    local = tuple(x.chunk(world)[rank] for x in inputs)
    return Variant.of_module(BASELINE_NAMES["zero1"], ddp, local, optimizer=optimizer)


def _pytorch_tp(model: WithLoss, inputs: tuple, rank: int, world: int) -> Variant:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    llama = model.model
    parallelize_module(
        llama,
        mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in llama.layers:
        parallelize_module(
            block,
            mesh,
            {
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
        attn = block.attn
        attn.n_head //= world  # heads of this rank, as torchtitan sets them
        attn.n_kv_head //= world
        attn.forward = types.MethodType(_local_attention_forward, attn)
    del Shard  # the plan above names its layouts through the styles
    return Variant.of_module(BASELINE_NAMES["tp"], model, inputs)


def _local_attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``autopar_examples.models.llama.Attention.forward`` on this rank's heads (its last reshape
    takes the local width, not the model's)."""
    from autopar_examples.models.llama import apply_rotary, repeat_kv, rotary_angles

    B, T, _ = x.shape  # (B, T, C)
    nh, nkv, hs = self.n_head, self.n_kv_head, self.head_size
    q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh_local, T, hs)
    k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)
    v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)
    cos, sin = rotary_angles(T, hs, self.rope_theta, x.device)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, C_local)
    return self.o_proj(y)


class _PipelineStage(nn.Module):
    """Stage ``index`` of ``stages`` of a Llama-style decoder, one block each: the embedding
    before the first block, the norm and head after the last (torchtitan's split)."""

    def __init__(self, llama: nn.Module, index: int, stages: int) -> None:
        super().__init__()
        per = len(llama.layers) // stages
        self.embed = llama.embed_tokens if index == 0 else None
        self.blocks = nn.ModuleList(llama.layers[index * per : (index + 1) * per])
        last = index == stages - 1
        self.norm = llama.norm if last else None
        self.head = llama.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _pytorch_pp(model: WithLoss, inputs: tuple, rank: int, world: int) -> Variant:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_module = _PipelineStage(model.model, rank, world)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, PIPELINE["microbatches"], loss_fn=_token_loss)
    tokens, targets = inputs

    def run() -> torch.Tensor | None:
        if rank == 0:
            schedule.step(tokens)
            return None
        if rank == world - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=losses)
            return torch.stack(losses).mean()
        schedule.step()
        return None

    optimizer = adamw(stage_module.parameters())
    return Variant(BASELINE_NAMES["pp"], run, optimizer)


BASELINES = {
    "pp": _pytorch_pp,
    "dp": _pytorch_dp,
    "fsdp": _pytorch_fsdp,
    "tp": _pytorch_tp,
    "zero1": _pytorch_zero1,
    "zero2": partial(_pytorch_fsdp, reshard=False),
}
ZERO = {"zero1": 1, "zero2": 2}


def _autopar(model: WithLoss, inputs: tuple, style: str | None, world: int, preset: str) -> Variant:
    axis = "tp" if style == "tp" else "dp"
    mesh = autopar.Mesh((world,), (axis,), device=preset)
    options: dict[str, Any] = {}
    if style in ZERO:
        options.update(force="dp", zero=ZERO[style])
    elif style == "dp":
        options.update(force="dp", zero=0)  # DDP: the free ZeRO stage is the "zero" rows'
    elif style == "pp":
        return _autopar_pipeline(model, inputs, mesh, **PIPELINE)
    elif style == "auto":  # the free choice, given the loss: pipelines among its choices
        return _autopar_pipeline(model, inputs, mesh)
    elif style:
        options["force"] = style
    if style == "tp":  # force="tp" alone lets the batch split on the tp axis too (FSDP-like)
        options["hints"] = {"ban": {"tp": ["data_parallel"]}}
    compiled = autopar.compile(model, mesh, example_inputs=inputs, **options)
    return Variant.of_module(f"autopar {style or 'none'}", compiled, inputs, plan=compiled.plan)


def _autopar_pipeline(
    model: WithLoss, inputs: tuple, mesh: autopar.Mesh, **options: Any
) -> Variant:
    """The decoder compiled with its loss (``loss_fn``, so the plan may be a pipeline),
    stepped by ``train_step``: the ``pp`` style's options, or none (``auto``)."""
    tokens, targets = inputs
    compiled = autopar.compile(
        model.model, mesh, example_inputs=(tokens,), loss_fn=_token_loss, **options
    )
    optimizer = adamw(compiled.parameters())
    name = "autopar pp" if options else "autopar auto"
    return Variant(name, lambda: compiled.train_step(tokens, targets), optimizer, compiled.plan)


def _run(variants: list[Variant], steps: int, warmup: int) -> None:
    for i in range(warmup + steps):
        for variant in variants if i % 2 == 0 else reversed(variants):
            variant.step(record=i >= warmup)


def ranks_work(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every strategy, autopar's and PyTorch's, on this rank; what it measured."""
    model, inputs = _make_model(cfg["model"], cfg["batch"])
    variants = []
    for style in STRATEGIES:
        variants.append(_autopar(copy.deepcopy(model), inputs, style, world, cfg["preset"]))
        variants.append(BASELINES[style](copy.deepcopy(model), inputs, rank, world))
    variants.append(_autopar(copy.deepcopy(model), inputs, "auto", world, cfg["preset"]))
    _run(variants, cfg["steps"], cfg["warmup"])
    return _report(variants)


def single_work(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """On one rank: the compiled module against the eager one."""
    model, inputs = _make_model(cfg["model"], cfg["batch"])
    variants = [
        _autopar(copy.deepcopy(model), inputs, None, world, cfg["single_preset"]),
        Variant.of_module("eager", copy.deepcopy(model), inputs),
    ]
    _run(variants, cfg["steps"], cfg["warmup"])
    return _report(variants)


def _report(variants: list[Variant]) -> dict[str, Any]:
    return {
        v.name: {
            "times": v.times,
            "bytes": v.bytes,
            "losses": v.losses,
            "plan_bytes": v.plan.estimate.comm_bytes_per_step if v.plan is not None else None,
            "predicted_s": v.plan.estimate.step_time_s if v.plan is not None else None,
            "parallelism": v.plan.parallelism.model_dump() if v.plan is not None else None,
        }
        for v in variants
    }


def combine(per_rank: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: the median over steps of the slowest rank's time; rank 0's bytes."""
    combined = {}
    for name in per_rank[0]:
        steps = zip(*(r[name]["times"] for r in per_rank), strict=True)
        slowest = [max(step) for step in steps]
        first = per_rank[0][name]
        combined[name] = {
            "step_s": statistics.median(slowest),
            "steps_s": slowest,
            "bytes_per_step": statistics.median(first["bytes"]),
            "plan_bytes_per_step": first["plan_bytes"],
            "predicted_s": first["predicted_s"],
            "parallelism": first["parallelism"],
            # the first step's loss where a rank has it (a pipeline's last stage)
            "loss_first": next(
                (r[name]["losses"][0] for r in per_rank if not math.isnan(r[name]["losses"][0])),
                float("nan"),
            ),
        }
    return combined


def run(quick: bool = False) -> dict[str, Any]:
    """Both jobs; the section's record."""
    cfg = config(quick)
    start = time.perf_counter()
    ranks = autopar.testing.run_ranks(ranks_work, cfg["world_size"], (cfg,))
    single = autopar.testing.run_ranks(single_work, 1, (cfg,))
    rows = []
    four = combine(ranks)
    for style in STRATEGIES:
        baseline = BASELINE_NAMES[style]
        mine, theirs = four[f"autopar {style}"], four[baseline]
        rows.append(_row(style, cfg["world_size"], mine, theirs, baseline))
    fastest = min(BASELINE_NAMES.values(), key=lambda name: four[name]["step_s"])
    rows.append(_row("auto", cfg["world_size"], four["autopar auto"], four[fastest], fastest))
    one = combine(single)
    rows.append(_row("none", 1, one["autopar none"], one["eager"], "eager"))
    return {"config": cfg, "rows": rows, "seconds": time.perf_counter() - start}


def _row(
    style: str, ranks: int, mine: dict[str, Any], theirs: dict[str, Any], baseline: str
) -> dict[str, Any]:
    ratios = sorted(a / b for a, b in zip(mine["steps_s"], theirs["steps_s"], strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "strategy": style,
        "step_ratio_quartiles": quartiles,
        "autopar_steps_s": mine["steps_s"],
        "baseline_steps_s": theirs["steps_s"],
        "ranks": ranks,
        "baseline": baseline,
        "autopar_step_s": mine["step_s"],
        "predicted_step_s": mine["predicted_s"],
        "baseline_step_s": theirs["step_s"],
        "ratio": mine["step_s"] / theirs["step_s"],
        "autopar_bytes": mine["bytes_per_step"],
        "baseline_bytes": theirs["bytes_per_step"],
        "plan_bytes": mine["plan_bytes_per_step"],
        "parallelism": mine["parallelism"],
        "losses": [mine["loss_first"], theirs["loss_first"]],
    }
