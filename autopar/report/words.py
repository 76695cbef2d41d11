"""A plan in the words a person uses, and what in it no one would train with.

``plan_in_words``: "data parallel 8 across nodes (node) x tensor parallel 8 inside nodes
(gpu), sequence parallel between the tensor-parallel matmuls, activations split by sequence
in 12 ops; FSDP (...); 16 microbatches of 4 sequences accumulated".
``cautions``: a microbatch split over more data-parallel devices than it has sequences, one
sequence a step spread over a mesh. Both read the plan alone, so a saved plan says the same.
"""

from __future__ import annotations

from autopar_plans.mesh import MeshSpec
from autopar_plans.plan import Plan

ROLES = {
    "data": "data parallel",
    "tensor": "tensor parallel",
    "expert": "expert parallel",
    "mixed": "split in mixed ways",  # some matmuls by tokens, some by weights
}
ZERO = {
    1: "ZeRO-1 (optimizer states split)",
    2: "ZeRO-2 (gradients and optimizer states split)",
    3: "FSDP (parameters, gradients and optimizer states split)",
}


def plan_in_words(plan: Plan) -> str:
    p = plan.parallelism
    mesh = plan.stage_mesh or plan.mesh
    axes = _axes_in_words(plan, mesh)
    said = " x ".join(axes) if axes else _unsplit(plan)
    if p.sp > 1:
        said += ", sequence parallel between the tensor-parallel matmuls"
    if p.sequence_split_ops:
        said += f", activations split by sequence in {_count(p.sequence_split_ops, 'op')}"
    parts = [said]
    if p.zero:
        parts.append(ZERO[p.zero])
    if p.pp > 1:
        chunks = f", {p.chunks} chunks a device" if p.chunks > 1 else ""
        parts.append(
            f"{p.pp} pipeline stages ({p.schedule}{chunks}) of "
            f"{_count(p.microbatches, 'microbatch')} of {_sequences(plan.microbatch_size)}"
        )
    elif p.microbatches > 1:
        parts.append(
            f"{p.microbatches} microbatches of {_sequences(plan.microbatch_size)} accumulated"
        )
    if plan.offload.active:
        parts.append("offloads to host memory")
    return "; ".join(parts)


def cautions(plan: Plan) -> list[str]:
    """What makes this plan no way to train, each with what to do instead."""
    p = plan.parallelism
    devices = plan.mesh.size
    if plan.global_batch == 1 and devices > 1:
        return [
            f"one sequence a step spread over {devices} devices is no way to train: plan "
            "for the batch you train with (autopar plan --global-batch N, or global_batch= "
            "in autopar.plan)"
        ]
    if p.dp > plan.microbatch_size:
        return [
            f"each microbatch of {_sequences(plan.microbatch_size)} is split over "
            f"{p.dp} data-parallel devices, so a device holds part of a sequence (its "
            f"tokens, not whole samples): for plain data parallelism, microbatches of at "
            f"least {p.dp} sequences (the hint pipeline: {{microbatches: N}} fixes their "
            "count) or a larger global batch"
        ]
    return []


def _axes_in_words(plan: Plan, mesh: MeshSpec) -> list[str]:
    p = plan.parallelism
    if len(p.axis_roles) != mesh.ndim:  # an older plan: the degrees alone
        found = [(ROLES["data"], p.dp), (ROLES["tensor"], p.tp), (ROLES["expert"], p.ep)]
        found.append((ROLES["mixed"], p.mixed))
        return [f"{words} {degree}" for words, degree in found if degree > 1]
    said = []
    for axis, (name, size, role) in enumerate(
        zip(mesh.axis_names, mesh.shape, p.axis_roles, strict=True)
    ):
        if size == 1 or not role:
            continue
        words = " and ".join(ROLES[r] for r in role.split("+"))
        if "data" in role.split("+") and p.dp > plan.microbatch_size:
            words = words.replace("data parallel", "data parallel over tokens")
        said.append(f"{words} {size}{_where(mesh, axis)} ({name})")
    return said


def _where(mesh: MeshSpec, axis: int) -> str:
    if mesh.gpus_per_node is None:
        return ""
    crosses = mesh.crosses_nodes(axis, mesh.gpus_per_node)
    return " across nodes" if crosses else " inside nodes"


def _unsplit(plan: Plan) -> str:
    if plan.parallelism.pp > 1:
        return "each stage's layers run whole on each of its devices"
    return "every device runs the whole model" if plan.mesh.size > 1 else "one device"


def _sequences(count: int) -> str:
    return _count(count, "sequence")


def _count(count: int, thing: str) -> str:
    plural = thing + ("es" if thing.endswith("ch") else "s")
    return f"{count} {thing if count == 1 else plural}"
