"""What a plan says, arranged for reading: the data behind the CLI's tables and the report.

- ``layout_rows``: parameter layouts per layer, identical layers folded into one row
  (``layers.*.attn.q_proj.weight`` in layers 0-31);
- ``memory_bars``: memory per device, per pipeline stage, in params, grads, optimizer
  states and activations;
- ``time_rows``: where the step time goes.

Everything here reads a ``autopar_plans.Plan`` only, so a saved plan shows the same as a fresh one.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar_plans.placement import Layout, Replicate, format_spec
from autopar_plans.plan import Plan


@dataclass(frozen=True)
class LayoutRow:
    """Parameters that share a name pattern, a shape and their layouts."""

    name: str  # with ``*`` for the layer index when the row stands for several layers
    layers: str  # "0-31", "0, 2" or "" outside the layers
    shape: tuple[int, ...]
    param: Layout
    grad: Layout
    optimizer: Layout
    stage: str  # pipeline stages holding it ("0", "0-3") or ""

    def spec(self, which: str, axis_names: tuple[str, ...]) -> str:
        """A layout in the JAX spelling: ``[tp, None]``."""
        return format_spec(getattr(self, which), axis_names, len(self.shape))


@dataclass(frozen=True)
class MemoryBar:
    """Bytes per device at the peak of the step, for one stage (or all devices)."""

    label: str
    params: float
    grads: float
    optimizer: float
    activations: float
    host: float = 0.0  # offloaded to host memory (``autopar_plans.offload``): not in total

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def plan_mesh_axes(plan: Plan) -> tuple[str, ...]:
    return (plan.stage_mesh or plan.mesh).axis_names


def shown_axes(plan: Plan) -> list[int]:
    """The mesh axes a layout view shows: those of more than one device (inside a stage,
    the outer axis is often one device, on which every tensor is whole)."""
    return [a for a, size in enumerate((plan.stage_mesh or plan.mesh).shape) if size > 1]


def layout_rows(plan: Plan) -> list[LayoutRow]:
    """Parameter layouts with identical layers folded: one row per name pattern and layout.

    A name's first numbered component is its layer index (``layers.7.mlp...``); names that
    differ only there and have the same shape and layouts make one row. A placement on a
    mesh axis of one device (a pipeline stage's outer axis when every device along it is a
    stage) keeps the whole tensor whatever the solver wrote there, so it is shown whole.
    """
    sizes = (plan.stage_mesh or plan.mesh).shape
    groups: dict[tuple[object, ...], list[int]] = {}
    order: list[tuple[object, ...]] = []
    for name, param in plan.params.items():
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        layer = int(parts[index]) if index is not None else -1
        pattern = ".".join("*" if i == index else p for i, p in enumerate(parts))
        layouts = (_on(param.param, sizes), _on(param.grad, sizes), _on(param.optimizer, sizes))
        key = (pattern, param.shape, *layouts)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(layer)
    stage_of = _stages_of_layers(plan)
    rows = []
    # a pattern's rows together, lowest layers first; outside the layers by name
    order.sort(key=lambda key: (str(key[0]), min(groups[key])))
    for key in order:
        pattern, shape, value, grad, optimizer = key
        layers = sorted(groups[key])
        numbered = layers != [-1]
        if numbered and len(layers) == 1:  # a single layer: its own name
            pattern = str(pattern).replace("*", str(layers[0]), 1)
        stages = sorted({stage_of[i] for i in layers if i in stage_of})
        rows.append(
            LayoutRow(
                name=str(pattern),
                layers=ranges(layers) if numbered else "",
                shape=shape,  # type: ignore[arg-type]
                param=value,  # type: ignore[arg-type]
                grad=grad,  # type: ignore[arg-type]
                optimizer=optimizer,  # type: ignore[arg-type]
                stage=ranges(stages) if stages else "",
            )
        )
    return rows


def _on(layout: Layout, sizes: tuple[int, ...]) -> Layout:
    """``layout`` with its placements on axes of one device replaced by ``Replicate``."""
    if all(size > 1 for size in sizes):
        return layout
    return Layout(*(Replicate() if size == 1 else p for p, size in zip(layout, sizes, strict=True)))


def _stages_of_layers(plan: Plan) -> dict[int, int]:
    found: dict[int, int] = {}
    for stage in plan.stages:
        for layer in range(stage.layers[0], stage.layers[1] + 1):
            found[layer] = stage.index
    return found


def ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    parts: list[str] = []
    start = prev = None
    for value in sorted(set(values)):
        if start is None:
            start = prev = value
        elif value == prev + 1:  # type: ignore[operator]
            prev = value
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = value
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


def memory_bars(plan: Plan) -> list[MemoryBar]:
    """Memory per device, one bar per pipeline stage (one for all devices without stages).

    A stage's estimate gives its activations and its total; its parameter states are split
    into params, grads and optimizer in the proportions of the plan's whole breakdown.
    """
    whole = plan.estimate.memory_per_device_bytes
    if not plan.estimate.stages:
        return [
            MemoryBar(
                "every device",
                whole.params,
                whole.grads,
                whole.optimizer,
                whole.activations,
                whole.host,
            )
        ]
    states = whole.params + whole.grads + whole.optimizer
    bars = []
    for stage in plan.estimate.stages:
        memory = stage.memory_per_device_bytes
        own = (
            (memory.params, memory.grads, memory.optimizer)
            if memory.params + memory.grads + memory.optimizer > 0
            else tuple(
                (memory.total - memory.activations) * part / states if states else 0.0
                for part in (whole.params, whole.grads, whole.optimizer)
            )
        )
        bars.append(MemoryBar(f"stage {stage.stage}", *own, memory.activations, memory.host))
    return bars


def time_rows(plan: Plan) -> list[tuple[str, float]]:
    """Where one step's time goes: the parts add up to the step time."""
    e = plan.estimate
    rows = [("compute (forward + backward)", e.compute_s)]
    if e.recompute_s:
        rows.append(("recomputation", e.recompute_s))
    rows.append(("communication not hidden", e.exposed_comm_s))
    if e.bubble_s:
        rows.append(("pipeline bubble", e.bubble_s))
    rest = e.step_time_s - sum(value for _, value in rows)
    if abs(rest) > 1e-6 * max(e.step_time_s, 1e-12):
        rows.append(("other", rest))
    return rows


def stage_times(plan: Plan) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per microbatch of each device of the pipeline, each
    with its half of the stage's hand-offs (activations go forward, their gradients come
    back). Without stages, one row: the step's compute per microbatch, one third forward
    and two thirds backward (the backward computes two gradients per matmul)."""
    if plan.estimate.stages:
        return (
            [s.forward_s + s.handoff_s / 2 for s in plan.estimate.stages],
            [s.backward_s + s.handoff_s / 2 for s in plan.estimate.stages],
        )
    per_microbatch = plan.estimate.compute_s / max(plan.parallelism.microbatches, 1)
    return [per_microbatch / 3], [2 * per_microbatch / 3]


def short_op(op: str) -> str:
    """An ATen op's short name: ``aten.linear.default`` -> ``linear``."""
    return op.removeprefix("aten.").split(".")[0]


def op_in_words(plan: Plan, node: str) -> str:
    """An op of the plan as its module and the ATen op's short name, the layer index
    folded (``layers.*.attn_norm mul``); the node's own name only where the plan does not
    record it."""
    op = plan.ops.get(node)
    if op is None:
        return node
    short = short_op(op.op)
    module = ".".join("*" if part.isdigit() else part for part in op.module.split("."))
    return f"{module} {short}" if module else short


def what_in_words(plan: Plan, what: str) -> str:
    """A ledger entry's reason with each op's node name said as ``op_in_words``."""
    return " ".join(
        op_in_words(plan, word) if word in plan.ops else word for word in what.split(" ")
    )


@dataclass(frozen=True)
class CommSource:
    """What one kind of collective's bytes in a step are spent on."""

    kind: str
    source: str  # ``what_in_words`` of the ledger entries it sums
    sent_per_step: float
    calls_per_step: int
    sites: int


def comm_sources(plan: Plan, top: int = 3) -> list[CommSource]:
    """Per kind of collective, the ``top`` reasons that send the most bytes a step per
    device (the sites of identical layers folded into one; in a pipeline, on the stage
    where the reason sends most), the kind that sends most first."""
    per_stage: dict[tuple[str, str, int], list[float]] = {}
    for entry in plan.estimate.comm:
        key = (entry.kind, what_in_words(plan, entry.what), entry.stage)
        held = per_stage.setdefault(key, [0.0, 0, 0])
        held[0] += entry.sent_per_step
        held[1] += entry.calls_per_step
        held[2] += 1
    found: dict[tuple[str, str], CommSource] = {}
    for (kind, source, _), (sent, calls, sites) in per_stage.items():
        known = found.get((kind, source))
        if known is None or sent > known.sent_per_step:
            found[(kind, source)] = CommSource(kind, source, sent, int(calls), int(sites))
    by_kind: dict[str, list[CommSource]] = {}
    for row in found.values():
        by_kind.setdefault(row.kind, []).append(row)
    ordered = sorted(by_kind.values(), key=lambda rows: -sum(r.sent_per_step for r in rows))
    return [
        row
        for rows in ordered
        for row in sorted(rows, key=lambda r: -r.sent_per_step)[:top]
        if row.sent_per_step > 0
    ]
