"""The solver against closed forms, and the lowering's collectives against the plan."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar_cost_model.collectives import MeshCost
from autopar_cost_model.hardware import load_preset
from autopar_examples.models import build, mlp
from autopar_passes.from_plan import PlanLayouts
from autopar_passes.lower_spmd import lower_spmd
from autopar_passes.solve import SolveRequest, solve_sharding
from autopar_passes.trace import trace
from autopar_plans import InfeasiblePlanError, Replicate, Shard


def big_mlp(batch: int = 8):
    """Two layers whose weights dwarf their activations: tensor parallelism's case."""
    return mlp(d_in=1024, d_hidden=4096, d_out=1024, n_layers=2, batch_size=batch, device="meta")


def test_pure_data_parallel_plan_costs_exactly_its_gradient_all_reduces():
    model, inputs = build("mlp-tiny", batch_size=8)
    mesh = autopar.Mesh((4,), ("dp",), device="h100-sxm")
    plan = autopar.plan(model, mesh, inputs, force="dp")
    preset = load_preset("h100-sxm")
    cost = MeshCost(mesh, preset)
    # the runtime sums the gradients in DDP's buckets: mlp-tiny's all fit the first one,
    # flattened into it first (a read and a write of every gradient byte)
    nbytes = sum(4 * _numel(p.shape) for p in plan.params.values())
    flatten = 2 * nbytes / (preset.memory_bandwidth * preset.efficiency.memory)
    gradient_sync = cost.all_reduce(nbytes, (0,)) + flatten
    # ... plus making the batch-sharded output whole for the caller, and its adjoint
    out = (8, 16)
    gather = cost.reshard(autopar.Layout(Shard(0)), autopar.Layout(Replicate()), out, 4).time
    scatter = cost.reshard(autopar.Layout(autopar.Partial()), autopar.Layout(Shard(0)), out, 4).time
    assert plan.estimate.comm_s == pytest.approx(gradient_sync + gather + scatter, rel=1e-12)
    assert plan.parallelism.dp == 4
    assert plan.estimate.collectives == {"all_gather": 1}  # the output, made whole


def test_fsdp_gathers_each_kept_weight_again_for_the_backward():
    """Forced FSDP on 4 devices: each layer's weight and bias are all-gathered together for
    the forward (``runtime.param_groups``); the runtime keeps no gathered weight
    (``runtime.regather``), so a layer whose weight backward needs is gathered again, as a
    group. The second layer's is (its input needs a gradient); the first layer's is not
    (its input is the model's, which needs none, so its backward keeps no weight). Which
    dim a weight is sharded along is a tie (the same bytes gathered)."""
    model, inputs = big_mlp()
    mesh = autopar.Mesh((4,), ("dp",), device="h100-sxm")
    plan = autopar.plan(model, mesh, inputs, force="fsdp")
    first, second = plan.params["layers.0.weight"], plan.params["layers.1.weight"]
    assert {first.param, second.param} <= {autopar.Layout(Shard(0)), autopar.Layout(Shard(1))}

    def gather(shape: tuple[int, ...]) -> float:  # fp32 bytes a device sends on a ring of 4
        return 4 * _numel(shape) * 3 / 4

    weights = gather(first.shape) + 2 * gather(second.shape)
    bias_0, bias_1 = plan.params["layers.0.bias"].shape, plan.params["layers.1.bias"].shape
    biases = gather(bias_0) + 2 * gather(bias_1)
    output = gather((8, 1024))  # the batch-split output, made whole for the caller
    assert plan.estimate.comm_bytes_by_kind["all_gather"] == pytest.approx(
        weights + biases + output
    )


def test_two_layer_mlp_gets_megatron_column_then_row_with_one_all_reduce():
    model, inputs = big_mlp()
    mesh = autopar.Mesh((4,), ("tp",), device="h100-sxm")
    plan = autopar.plan(model, mesh, inputs)
    first, second = plan.params["layers.0.weight"], plan.params["layers.1.weight"]
    # nn.Linear's weight is [out, in]: column-parallel splits out (dim 0), row-parallel in.
    assert first.param == autopar.Layout(Shard(0))
    assert second.param == autopar.Layout(Shard(1))
    assert plan.parallelism.tp == 4
    linear = [o for o in plan.ops.values() if o.op == "aten.linear.default"]
    assert [str(o.output) for o in linear] == ["[S(1)]", "[P]"]
    assert plan.estimate.collectives == {"all_reduce": 1}


def test_an_axis_split_half_by_batch_and_half_by_weight_is_labelled_mixed(tmp_path):
    """Neither data nor tensor parallelism is true of an axis that splits one of two equal
    matmuls by the batch and the other by its weight: ``parallelism`` says so."""
    hints = tmp_path / "half.yaml"
    hints.write_text(
        'mesh: {axes: [x]}\nshard:\n  "0": [x]\n  "2.weight": [x, null]\n  "2": [null, x]\n'
    )
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    mesh = autopar.Mesh((4,), ("x",), device="h100-sxm")
    plan = autopar.plan(model, mesh, (torch.randn(32, 64),), stages=1, hints=str(hints))
    p = plan.parallelism
    assert (p.dp, p.tp, p.mixed) == (1, 1, 4)
    free = autopar.plan(model, mesh, (torch.randn(32, 64),), stages=1)
    assert free.parallelism.mixed == 1


def test_lowered_code_runs_the_collectives_the_plan_counts():
    for name, shape, force in [
        ("gpt-tiny", (2, 2), "tp+sp"),
        ("llama-tiny", (2, 2), None),
        ("gpt-tiny", (4,), "fsdp"),
    ]:
        model, inputs = build(name, batch_size=4)
        mesh = autopar.Mesh(shape, device="cpu")
        plan = autopar.plan(model, mesh, inputs, force=force)
        traced = trace(model, inputs)
        layouts = PlanLayouts(traced, plan)
        for rank in range(mesh.size):
            lowered = lower_spmd(
                traced, layouts.strategy, layouts.layout, mesh, mesh.coordinates(rank)
            )
            assert lowered.counts == plan.estimate.collectives, (name, force, rank)


def test_zero_1_is_the_fastest_data_parallel_plan_where_its_gathers_cost_less_than_the_step():
    """On 4 devices ZeRO-1 steps a quarter of the values, and gathers the stepped masters
    after the step, where DDP sums the whole gradient. The step streams 80 bytes a value
    through HBM (AdamW, ``autopar_cost_model.optimizer``); on NVLink the gather of 3 of a value's 4
    bytes costs less than the three quarters of the step it saves, so the free data-parallel
    plan is ZeRO-1 with memory to spare."""
    model, inputs = big_mlp(batch=64)
    mesh = autopar.Mesh((4,), ("x",), device="h100-sxm")
    free = autopar.plan(model, mesh, inputs, force="dp")
    plain = autopar.plan(model, mesh, inputs, force="dp", zero=0)
    assert (free.parallelism.zero, plain.parallelism.zero) == (1, 0)
    assert free.estimate.optimizer_s == pytest.approx(plain.estimate.optimizer_s / 4)
    gathers = sum(e.time_s for e in free.estimate.comm if e.phase == "step")
    saved = plain.estimate.optimizer_s * 3 / 4
    assert 0 < gathers < saved
    assert free.estimate.step_time_s < plain.estimate.step_time_s


def test_memory_limit_turns_on_sharding_and_below_the_floor_says_how_much():
    model, inputs = big_mlp(batch=64)
    mesh = autopar.Mesh((4,), ("x",), device="h100-sxm")
    roomy = autopar.plan(model, mesh, inputs, force="dp", zero=0)
    assert roomy.parallelism.zero == 0
    need = roomy.estimate.memory_per_device_bytes.total
    optimizer = roomy.estimate.memory_per_device_bytes.optimizer
    tight = autopar.plan(model, mesh, inputs, force="dp", memory_limit=need - optimizer / 2)
    assert tight.parallelism.zero in (1, 2)
    assert tight.estimate.memory_per_device_bytes.total <= need - optimizer / 2
    for p in tight.params.values():  # still data parallel, optimizer state sharded
        assert p.param == autopar.Layout(Replicate())
        assert isinstance(p.optimizer[0], Shard)
    with pytest.raises(InfeasiblePlanError, match=r"needs .* per device .* dominate"):
        autopar.plan(model, mesh, inputs, memory_limit="1MiB")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def test_a_solver_time_out_returns_the_best_plan_with_its_gap_and_a_warning(monkeypatch):
    """HiGHS stopping at its time limit with a feasible plan (made deterministic here by
    reporting a found-but-unproven solution) gives that plan, its gap, and a warning."""
    import autopar_passes.solve as solve_module
    from autopar_passes.ilp import solve_ilp

    def stopped_early(problem, time_limit, backend="highs", cutoff=None, work_cutoff=None):
        solution = solve_ilp(problem, time_limit, backend, cutoff, work_cutoff)
        if not solution.feasible:  # a proof under a cutoff: no plan to stop early with
            return solution
        report = solution.report.model_copy(
            update={"status": "feasible (time limit; best found)", "gap": 0.07}
        )
        return type(solution)(solution.choice, report, True)

    monkeypatch.setattr(solve_module, "solve_ilp", stopped_early)
    model, inputs = build("mlp-tiny")
    with pytest.warns(autopar.PlanWarning, match="time limit"):
        plan = autopar.plan(model, autopar.Mesh((2,), device="cpu"), inputs, time_limit=5)
    assert plan.solver.gap == 0.07
    assert any("time limit" in w and "gap 0.07" in w for w in plan.warnings)


def test_a_solve_stopped_by_its_work_limit_says_so_and_that_the_clock_did_not_decide(
    monkeypatch,
):
    """Stopped by its budget of work (``ilp.WorkLimit``), the plan is the best found, with
    its gap, and a note that any machine gives it."""
    import autopar_passes.solve as solve_module
    from autopar_passes.ilp import solve_ilp

    def stopped_early(problem, time_limit, backend="highs", cutoff=None, work_cutoff=None):
        solution = solve_ilp(problem, time_limit, backend, cutoff, work_cutoff)
        if not solution.feasible:  # a proof under a cutoff: no plan to stop early with
            return solution
        status = "feasible (work limit of 200 solver checkpoints; best found)"
        report = solution.report.model_copy(update={"status": status, "gap": 0.03})
        return type(solution)(solution.choice, report, True)

    monkeypatch.setattr(solve_module, "solve_ilp", stopped_early)
    model, inputs = build("mlp-tiny")
    with pytest.warns(autopar.PlanWarning, match="s of work, the same on any machine"):
        plan = autopar.plan(model, autopar.Mesh((2,), device="cpu"), inputs)
    assert plan.solver.gap == 0.03


def test_no_plan_within_the_time_limit_says_to_allow_more_time(monkeypatch):
    import autopar_passes.solve as solve_module
    from autopar_passes.ilp import solve_ilp

    def nothing_found(problem, time_limit, backend="highs", cutoff=None, work_cutoff=None):
        solution = solve_ilp(problem, time_limit, backend, cutoff, work_cutoff)
        return type(solution)({}, solution.report, False, timed_out=True)

    monkeypatch.setattr(solve_module, "solve_ilp", nothing_found)
    model, inputs = build("mlp-tiny")
    with pytest.raises(InfeasiblePlanError, match="time limit of 5 s of time, by the clock"):
        autopar.plan(model, autopar.Mesh((2,), device="cpu"), inputs, time_limit=5)


def test_constraints_that_allow_no_strategy_for_an_op_name_it_with_or_without_a_limit():
    """A constraint no strategy of some op meets: the solve says which op, and its shape,
    before any ILP (without a memory limit, as the pipeline search's first solve, it went on
    to the memory-limited solves as if the plan had only been too large, and crashed)."""
    model, inputs = build("mlp-tiny", batch_size=8)
    traced = trace(model, inputs)
    mesh = autopar.Mesh((4,), ("dp",), device="h100-sxm")

    def nothing_for_the_first_matmul(mesh):
        return [lambda node, choices, strategy: node != "linear"]

    for memory_limit in (None, 80 * 2.0**30):
        request = SolveRequest(mesh, memory_limit, constraints=nothing_for_the_first_matmul)
        with pytest.raises(InfeasiblePlanError, match=r"no strategy for linear \(aten.linear"):
            solve_sharding(traced, request)
