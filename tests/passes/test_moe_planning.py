"""Expert parallelism from the einsum rules, and the plans of mixture-of-experts models.

Nothing in the solver names experts: the GShard einsums of ``examples/models/moe.py`` give
it the choice to shard the group dim (data parallel) or the expert dim (expert parallel) on
each mesh axis, and the reshard between them is an all-to-all the cost model prices. Here:
the einsums' strategies brute-forced on simulated meshes, that reshard's cost, how a plan
reads ep off its layouts, the all-to-all bytes of an ep plan against a closed form, the
sparse (Hugging Face Mixtral) block planned with and without rules for its scatter ops, the
data-dependent original refused with a clear error, and Mixtral 8x7B on 8 nodes of 8 GPUs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import force
from autopar.testing.simulate import first_mismatch
from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.hardware import load_preset
from autopar_examples.models import build
from autopar_examples.models.moe import expert_capacity
from autopar_passes import experts
from autopar_passes.strategies import graph, scatter
from autopar_passes.strategies.matmul import einsum_rule
from autopar_passes.strategies.table import rules
from autopar_passes.strategies.validate import check_rule, describe_failures
from autopar_passes.trace import trace
from autopar_plans import Layout, Shard, UntraceableModelError

aten = torch.ops.aten
_GEN = torch.Generator().manual_seed(0)

G, S, E, C, D, F_ = 4, 6, 4, 3, 8, 4
EINSUMS = {  # GShard's three, as examples/models/moe.py writes them
    "dispatch": ("gsec,gsd->egcd", (G, S, E, C), (G, S, D)),
    "experts": ("egcd,edf->egcf", (E, G, C, D), (E, D, F_)),
    "combine": ("gsec,egcd->gsd", (G, S, E, C), (E, G, C, D)),
}


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=_GEN)


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("name", list(EINSUMS))
def test_moe_einsum_strategies_match_the_unsharded_op(name: str, mesh: tuple[int, ...]) -> None:
    equation, a, b = EINSUMS[name]
    strategies, failures = check_rule(
        einsum_rule, aten.einsum.default, (equation, [r(*a), r(*b)]), None, mesh
    )
    assert not failures, describe_failures(failures)
    names = {s.name for s in strategies}
    if mesh == (2,):
        # data parallel (groups split) and expert parallel (experts split) are both offered
        assert {
            "dispatch": {"S(0),S(0)->S(1)", "S(2),R->S(0)"},
            "experts": {"S(1),R->S(1)", "S(0),S(0)->S(0)"},
            "combine": {"S(0),S(1)->S(0)", "S(2),S(0)->P"},
        }[name] <= names
    if mesh == (2, 2):  # experts on one axis, groups on the other
        assert {
            "dispatch": "S(0)S(0),S(0)S(0)->S(1)S(1)",
            "experts": "S(1)S(0),RS(0)->S(1)S(0)",
            "combine": "S(0)S(0),S(1)S(1)->S(0)S(0)",
        }[name] in names


def test_groups_to_experts_is_one_all_to_all_of_a_device_share() -> None:
    mesh = autopar.Mesh((2, 4), ("dp", "ep"), device="h100-sxm")
    cost = MeshCost(mesh, load_preset("h100-sxm"))
    shape = (8, 16, 32, 64)  # (E, G, C, d)
    nbytes = 4 * math.prod(shape)
    # groups split over both axes -> groups over dp, experts over ep
    reshard = cost.reshard(Layout(Shard(1), Shard(1)), Layout(Shard(1), Shard(0)), shape, 4)
    (step,) = reshard.collectives
    assert (step.kind, step.axes) == ("all_to_all", (1,))
    assert step.nbytes == nbytes / 8  # each device's buffer: its share
    assert reshard.sent == pytest.approx(nbytes / 8 * 3 / 4)  # it keeps 1/4 of it


def test_expert_matmuls_are_the_ones_with_a_stacked_weight() -> None:
    assert experts.expert_dims("egcd,edf->egcf", weight=1) == (0, 0)
    assert experts.expert_dims("egcf,efd->egcd", weight=1) == (0, 0)
    assert experts.expert_dims("bsh,fh->bsf", weight=1) is None
    model, inputs = build("moe-tiny", n_layer=1)
    traced = trace(model, inputs)
    choices, _ = graph.graph_choices(traced.graph, (2,))
    found = {
        c.params[m.weight]: m
        for c in choices.values()
        if (m := experts.expert_matmul(c)) is not None
    }
    # the dispatch and combine einsums have the same subscript pattern but no parameter
    assert set(found) == {f"layers.0.moe.experts.w_{w}" for w in ("gate", "up", "down")}
    assert all((m.weight, m.weight_dim, m.tokens_dim) == (1, 0, 0) for m in found.values())


def test_the_batch_of_a_gshard_einsum_is_its_group_letter() -> None:
    """What forced data parallelism splits in each einsum: the group ``g``, wherever the
    operand has it; the expert weight has no batch (it is replicated or gathered)."""
    model, inputs = build("moe-tiny", n_layer=1)
    traced = trace(model, inputs)
    choices, _ = graph.graph_choices(traced.graph, (2,))
    dims = {
        str(c.call.args[0]): force.batch_dims(c)
        for c in choices.values()
        if c.call is not None and str(c.call.target) == "aten.einsum.default"
    }
    assert dims["gsec,gsd->egcd"] == [0, 0]
    assert dims["egcd,edf->egcf"] == [1, None]
    assert dims["egcf,efd->egcd"] == [1, None]
    assert dims["gsec,egcd->gsd"] == [0, 1]


@pytest.mark.parametrize("style", ["dp", "fsdp", "tp", "tp+sp"])
def test_dense_styles_plan_a_mixture_of_experts_without_splitting_the_experts(style: str):
    """DDP, FSDP and Megatron TP (with sequence parallelism) of a mixture of experts (the
    plan-quality baselines): every device runs every expert (ep 1) on its groups of tokens;
    FSDP stores the expert weights sharded, Megatron splits them inside each expert on the
    tp axis, never on the expert dim, and with ``tp+sp`` the residual stream on the
    sequence (the routing's (groups, 1, experts) slot counts are no residual stream)."""
    model, inputs = build("moe-tiny", batch_size=8, device="meta")
    mesh = autopar.Mesh((2, 4), ("dp", "tp"), device="h100-sxm")
    plan = autopar.plan(model, mesh, inputs, force=style)
    assert plan.parallelism.ep == 1
    assert "all_to_all" not in plan.estimate.collectives
    w_gate = plan.params["layers.0.moe.experts.w_gate"].param
    if style == "dp":
        assert w_gate.is_replicated and plan.parallelism.dp == 8
    elif style == "fsdp":
        assert all(isinstance(w_gate[axis], Shard) for axis in (0, 1))
        assert plan.parallelism.zero == 3
    else:
        assert isinstance(w_gate[1], Shard) and w_gate[1].dim != 0
        assert not isinstance(w_gate[0], Shard)
        assert plan.parallelism.tp == 4
        assert plan.parallelism.sp == (4 if style == "tp+sp" else 1)


def test_ep_plan_moves_exactly_the_expert_slots_by_all_to_all() -> None:
    """Closed form: per layer the expert inputs go out and the outputs come back (two
    all-to-alls forward, their adjoints backward), each of one device's share of the
    (E, G, C, d) slots, of which it keeps 1/n."""
    n, batch, seq, layers = 4, 8, 16, 2
    model, inputs = build("moe-tiny", batch_size=batch, n_layer=layers)
    mesh = autopar.Mesh((n,), ("ep",), device="h100-sxm")
    plan = autopar.plan(model, mesh, inputs, force="ep")
    capacity = expert_capacity(seq, 4, 2, 1.25)
    share = 4 * 4 * batch * capacity * 32 / n  # fp32 (E, G, C, d) / n
    assert plan.estimate.collectives["all_to_all"] == 2 * layers
    expected = 4 * layers * share * (n - 1) / n
    assert plan.estimate.comm_bytes_by_kind["all_to_all"] == pytest.approx(expected)
    assert plan.parallelism.ep == n and plan.parallelism.dp == n
    assert plan.parallelism.zero == 0  # experts split where they are used: not FSDP
    assert sum(plan.estimate.comm_bytes_by_kind.values()) == pytest.approx(
        plan.estimate.comm_bytes_per_step
    )


def test_sparse_block_plans_and_every_node_reassembles_on_2x2() -> None:
    torch.manual_seed(0)
    model, inputs = build("mixtral-sparse-tiny", batch_size=4, n_layer=1)
    mesh = autopar.Mesh((2, 2), device="cpu")
    plan = autopar.plan(model, mesh, inputs)
    assert not [w for w in plan.warnings if "no sharding rule" in w]
    assert first_mismatch(trace(model, inputs), plan, model, inputs) is None


def test_sparse_block_without_scatter_rules_is_replicated_and_still_right(monkeypatch) -> None:
    """Ops without a rule fall back to replicate-all with a warning: slower, never wrong."""
    table = {op: rule for op, rule in rules().items() if op not in scatter.RULES}
    monkeypatch.setattr(graph, "rule_for", table.get)
    torch.manual_seed(0)
    model, inputs = build("mixtral-sparse-tiny", n_layer=1)
    mesh = autopar.Mesh((2,), device="cpu")
    with pytest.warns(autopar.PlanWarning, match="no sharding rule"):
        plan = autopar.plan(model, mesh, inputs)
    warned = " ".join(plan.warnings)
    for op in ("aten.index_add.default", "aten.scatter.src", "aten.scatter.value"):
        assert f"no sharding rule for {op}" in warned
    assert first_mismatch(trace(model, inputs), plan, model, inputs) is None


class WhereBlock(nn.Module):
    """Hugging Face's MixtralSparseMoeBlock loop, verbatim in the part that matters."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, selected = F.softmax(self.gate(hidden), dim=-1).topk(2, dim=-1)
        out = torch.zeros_like(hidden)
        mask = F.one_hot(selected, num_classes=4).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            idx, top_x = torch.where(mask[e])
            out = out.index_add(0, top_x, expert(hidden[top_x]) * weights[top_x, idx, None])
        return out


def test_data_dependent_routing_is_refused_with_what_to_do() -> None:
    with pytest.raises(UntraceableModelError, match=r"aten\.where.*fixed capacity per expert"):
        trace(WhereBlock(), (torch.randn(16, 8),))


@pytest.mark.slow
def test_mixtral_on_8x8_puts_experts_on_the_fast_axis() -> None:
    """64 sequences (one per GPU), expert parallelism asked for: the 8 experts go over the
    8 GPUs of a node (NVLink) and the groups over the nodes, with all-to-alls inside the
    node. (Left free, the solver now prefers FSDP for this two-layer model: with each
    reshard step priced on its own axis, as the runtime runs it, the whole logits cost
    what they do.)"""
    model, inputs = build("mixtral-8x7b", device="meta", n_layer=2, batch_size=64)
    mesh = autopar.Mesh.cluster(nodes=8, gpus_per_node=8, device="h100-sxm")
    plan = autopar.plan(model, mesh, inputs, force="ep")
    assert plan.parallelism.ep == 8 and plan.parallelism.dp == 64
    for name, param in plan.params.items():
        if ".experts." in name:
            assert param.param[1] == Shard(0), name  # the gpu axis splits the expert dim
    assert plan.estimate.collectives["all_to_all"] >= 2 * 2
    assert plan.estimate.comm_bytes_by_kind["all_to_all"] > 0
