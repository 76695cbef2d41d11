"""Work for ``test_reduction.py``: a bucket summed over the axes of a gloo mesh in each form,
and a compiled model trained under each form."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.runtime.comm import CommLog
from autopar.runtime.groups import axis_groups
from autopar.runtime.reduction import steps_for, sum_flat
from autopar_examples.models import build
from autopar_plans.mesh import MeshSpec
from autopar_plans.reduction import GradReduction
from tests.autopar.runtime.features import cross_entropy

NUMEL = 1001  # odd: the hierarchical form pads it to split evenly


def _bucket(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))


def sum_in_each_form(rank: int, world: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """This rank's bucket summed per axis and hierarchically, with the calls each made,
    and the exact sum (float64) of every rank's bucket."""
    names = ("node", "gpu", "core")[-len(shape) :]
    log = CommLog()
    groups = [g for g in axis_groups(MeshSpec(shape, names), log) if g is not None]
    found: dict[str, Any] = {
        "exact": sum(_bucket(r).double() for r in range(world)),
        "order": names,
    }
    for form in ("per_axis", "hierarchical"):
        policy = GradReduction(form=form, axis_order=names[::-1])
        log.clear()
        found[form] = {
            "sum": sum_flat(_bucket(rank), policy, groups),
            "calls": [(c.kind, c.axes, c.dtype, c.nbytes) for c in log.calls],
            "steps": steps_for(policy, groups),
        }
    return found


def train_in_each_form(rank: int, world: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """gpt-tiny, data parallel over every axis of ``shape``, two AdamW steps per form: the
    gradients of the first step, the losses, and the second step's collectives observed
    and planned."""
    names = ("node", "gpu", "core")[-len(shape) :]
    found = {}
    for form in ("per_axis", "hierarchical"):
        torch.manual_seed(0)
        model, (tokens,) = build("gpt-tiny", batch_size=world)
        compiled = autopar.compile(
            model,
            autopar.Mesh(shape, names, device="cpu"),
            example_inputs=(tokens,),
            force="dp",
            zero=0,
            reduction_form=form,
        )
        optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
        losses, grads = [], {}
        for step in range(2):
            compiled.reset_observed()
            optimizer.zero_grad()
            loss = cross_entropy(compiled(tokens), tokens)
            loss.backward()
            if step == 0:
                grads = {n: p.grad.full_tensor().clone() for n, p in compiled.named_parameters()}
            optimizer.step()
            losses.append(float(loss))
        from autopar_plans.ledger import tally_entries

        found[form] = {
            "losses": losses,
            "grads": grads,
            "observed": compiled.observed_collectives(),
            "planned": tally_entries(compiled.plan.estimate.comm),
            "form": compiled.plan.grad_reduction.form,
        }
        dist.barrier()
    return found
