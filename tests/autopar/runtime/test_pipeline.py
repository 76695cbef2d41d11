"""Pipeline plans train exactly like the single-device model, on real gloo ranks.

For the GPT and Llama examples (tiny; GPT ties its embedding and head, so the tied weight
lives on the first and the last stage): pp=2 on 2 ranks with each schedule (GPipe, 1F1B,
interleaved 1F1B with 4 layers in 2 x 2 chunks); pp=2 x dp=2 and pp=2 x tp=2 on 4 ranks,
stages cut inside a node's axis (pp=2 x tp=2 on a 1 x 4 mesh) and across both axes (pp=4
on 2 x 2);
and ``train_step`` without a pipeline (gradient accumulation over 2 microbatches). The
loss of every step, every gradient after the first step (gathered over the stage's mesh,
from the stage that holds the parameter) and every parameter after 2 AdamW steps equal
the single-device run over the whole batch in fp32, to rtol 1e-4.

Bad input (a stage count larger than the layers, microbatches that do not divide the
batch, an unknown schedule, ...) gets one clear error, through ``autopar.plan`` and through
``autopar.compile`` (on every rank).
"""

from __future__ import annotations

import pytest

import autopar
from autopar.runtime.pipeline import schedule_to_run
from autopar.testing.ranks import run_ranks
from autopar_examples.models import build
from autopar_plans.plan import Parallelism
from tests.autopar.runtime.closeness import assert_same_training
from tests.autopar.runtime.pipelines import BATCH, case_name, compare, cross_entropy

ON_TWO = [
    ("gpt-tiny", 2, (2,), ("x",), {"stages": 2, "schedule": "1f1b", "microbatches": 4}),
    ("gpt-tiny", 2, (2,), ("x",), {"stages": 2, "schedule": "gpipe", "microbatches": 2}),
    (
        "llama-tiny",
        4,
        (2,),
        ("x",),
        {"stages": 2, "schedule": "interleaved", "microbatches": 4, "chunks": 2},
    ),
    ("gpt-tiny", 2, (2,), ("x",), {"stages": 1, "microbatches": 2, "force": "dp"}),
]
ON_FOUR = [
    (
        "gpt-tiny",
        2,
        (4,),
        ("x",),
        {"stages": 2, "schedule": "1f1b", "microbatches": 2, "force": "dp"},
    ),
    (
        "llama-tiny",
        2,
        (2, 2),
        ("pp", "tp"),
        {"stages": 2, "schedule": "gpipe", "microbatches": 2, "force": "tp"},
    ),
    (
        "gpt-tiny",
        4,
        (4,),
        ("x",),
        {"stages": 2, "schedule": "interleaved", "microbatches": 2, "chunks": 2, "force": "tp"},
    ),
    # stages cut inside the inner axis (one node of 4): each stage is 2 of its devices
    (
        "llama-tiny",
        2,
        (1, 4),
        ("node", "gpu"),
        {"stages": 2, "schedule": "1f1b", "microbatches": 2, "force": "tp"},
    ),
    # four stages on 2 x 2: whole outer axis, then the inner one; a device per stage
    ("gpt-tiny", 4, (2, 2), ("node", "gpu"), {"stages": 4, "schedule": "1f1b", "microbatches": 4}),
]
# case name -> (world size, case)
CASES = {
    case_name(name, layers, shape, options): (world, options)
    for world, cases in ((2, ON_TWO), (4, ON_FOUR))
    for name, layers, shape, _, options in cases
}

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """World size -> every rank's results, each world's ranks spawned once, when needed."""
    return {}


def _run(runs: dict[int, list[dict]], world: int) -> list[dict]:
    if world not in runs:
        runs[world] = run_ranks(compare, world, (ON_TWO if world == 2 else ON_FOUR, world == 2))
    return runs[world]


def _result(runs: dict[int, list[dict]], case: str) -> tuple[dict, list[dict]]:
    """Rank 0's result of ``case``, and every rank's results of its world."""
    by_rank = _run(runs, CASES[case][0])
    (found,) = [r for r in by_rank[0]["cases"] if r["case"] == case]
    return found, by_rank


@pytest.mark.parametrize("case", list(CASES))
def test_train_step_equals_single_device(runs: dict, case: str) -> None:
    result, by_rank = _result(runs, case)
    assert_same_training(result)
    assert result["state_keys"] == result["ref_state_keys"]
    index = [r["case"] for r in by_rank[0]["cases"]].index(case)
    for rank in by_rank[1:]:  # every rank returns the same loss
        assert rank["cases"][index]["losses"] == result["losses"]


@pytest.mark.parametrize("case", list(CASES))
def test_clip_grad_norm_measures_every_stage_once(runs: dict, case: str) -> None:
    # each rank holds its stages' parameters; a tied embedding and head, held by the first
    # and last stage, counts once
    result, _ = _result(runs, case)
    assert result["norm"] == pytest.approx(result["ref_norm"], rel=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_runs_what_was_asked(runs: dict, case: str) -> None:
    result, _ = _result(runs, case)
    options = CASES[case][1]
    parallelism = result["parallelism"]
    assert parallelism["pp"] == options["stages"]
    assert parallelism["microbatches"] == options["microbatches"]
    if options["stages"] > 1:
        assert parallelism["schedule"] == options["schedule"]
        assert parallelism["chunks"] == options.get("chunks", 1)
        assert result["code"].count("# pipeline stage") == options.get("chunks", 1)
    if options.get("force") in ("dp", "tp"):
        assert parallelism[options["force"]] == 2


def test_tied_weight_lives_on_the_first_and_last_stage(runs: dict) -> None:
    """GPT's wte.weight (= lm_head.weight) is read by the embedding (first stage) and the
    head (last stage): both hold it (its gradient, summed across them, is checked above);
    every other parameter lives on one stage."""
    case = case_name("gpt-tiny", 2, (2,), ON_TWO[0][4])
    result, by_rank = _result(runs, case)
    index = [r["case"] for r in by_rank[0]["cases"]].index(case)
    first, last = (set(rank["cases"][index]["held"]) for rank in by_rank)
    assert first & last == {"wte.weight"}
    assert first | last == set(result["ref_params"])
    assert "layers.0.ln_1.weight" in first and "ln_f.weight" in last


def test_bad_compile_is_refused_on_every_rank(runs: dict) -> None:
    expected = {
        "stages > layers": "at most one stage per layer",
        "microbatches do not divide": "do not divide the global batch",
        "pipeline without a loss": "loss_fn",
        "train_step without a loss": "loss_fn",
        "forward of a pipeline": "train_step",
        "train_step of a microbatch": "whole batch of 8",
    }
    for rank in _run(runs, 2):
        found = rank["refusals"]
        for what, words in expected.items():
            assert words in found.get(what, ""), (what, found.get(what))


def test_lazy_compile_plans_on_the_first_train_step(runs: dict) -> None:
    """Without example inputs, the first train_step's batch plans the model."""
    case = case_name("gpt-tiny", 2, (2,), ON_TWO[0][4])  # the same model and batch
    first = _result(runs, case)[0]["ref_losses"][0]
    for rank in _run(runs, 2):
        assert rank["refusals"]["lazy loss"] == pytest.approx(first, rel=1e-5)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"stages": 3}, "at most one stage per layer"),
        ({"stages": 2, "microbatches": 3}, "do not divide the global batch"),
        ({"stages": 2, "schedule": "zigzag"}, "schedule"),
        ({"stages": 2, "schedule": "interleaved", "chunks": 2}, "interleaved"),
    ],
)
def test_bad_pipeline_options_are_refused_by_plan(options: dict, words: str) -> None:
    model, (tokens,) = build("gpt-tiny", batch_size=BATCH, device="meta")
    mesh = autopar.Mesh((2,), ("x",), device="cpu")
    with pytest.raises(autopar.UsageError, match=words):
        autopar.plan(model, mesh, (tokens,), global_batch=BATCH, **options)


def test_unknown_schedule_is_refused_by_compile_before_anything_starts() -> None:
    model, _ = build("gpt-tiny", batch_size=BATCH)
    mesh = autopar.Mesh((2,), ("x",), device="cpu")
    with pytest.raises(autopar.UsageError, match="schedule"):
        autopar.compile(model, mesh, loss_fn=cross_entropy, stages=2, schedule="zigzag")


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches", "runs"),
    [
        ("1f1b", 2, 4, "1f1b"),
        ("1f1b", 4, 2, "gpipe"),  # all in flight either way; torch's 1F1B refuses m < pp
        ("gpipe", 4, 1, "gpipe"),
        ("interleaved", 2, 4, "interleaved"),
        ("interleaved", 4, 2, "interleaved"),
    ],
)
def test_the_schedule_torch_runs(schedule: str, pp: int, microbatches: int, runs: str) -> None:
    chunks = 2 if schedule == "interleaved" else 1
    par = Parallelism(pp=pp, schedule=schedule, microbatches=microbatches, chunks=chunks)
    assert schedule_to_run(par) == runs


def test_interleaved_microbatches_in_broken_rounds_are_refused() -> None:
    par = Parallelism(pp=2, schedule="interleaved", microbatches=5, chunks=2)
    with pytest.raises(autopar.UsageError, match="whole number of rounds"):
        schedule_to_run(par)
