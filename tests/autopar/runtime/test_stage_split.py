"""How one device's lowered program is cut into pipeline stages (no processes).

What crosses each cut, what is recomputed rather than sent, who holds a tied weight, and
what ``autopar codegen`` prints for a pipeline rank.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import autopar
from autopar.cli import main as cli
from autopar_examples.models import build
from autopar_passes.from_plan import PlanLayouts
from autopar_passes.lower_spmd import lower_spmd
from autopar_passes.lower_stages import StageProgram, holders, locate, split_stages, stage_mesh
from autopar_passes.trace import trace
from autopar_plans.plan import Plan


def _split(model: nn.Module, inputs: tuple, plan: Plan, rank: int = 0) -> list[StageProgram]:
    size = plan.microbatch_size
    traced = trace(model, tuple(x[:size] for x in inputs))
    layouts = PlanLayouts(traced, plan)
    coords = locate(plan, rank).coords
    lowered = lower_spmd(traced, layouts.strategy, layouts.layout, stage_mesh(plan), coords)
    return split_stages(traced, lowered, plan)


def _ops(program: StageProgram) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


def test_gpt_cut_sends_the_residual_stream_and_recomputes_the_tied_weight() -> None:
    model, (tokens,) = build("gpt-tiny", batch_size=4)
    mesh = autopar.Mesh((2,), ("x",), device="cpu")
    plan = autopar.plan(model, mesh, (tokens,), stages=2, schedule="1f1b", microbatches=2)
    first, last = _split(model, (tokens,), plan)
    assert first.sends == last.receives and len(first.sends) == 1  # the residual stream
    assert first.receives == () and last.sends == ()
    assert first.user_inputs == last.user_inputs == ("idx",)  # every stage gets the inputs
    assert "aten.embedding.default" in _ops(first)
    assert "aten.embedding.default" not in _ops(last)
    assert "aten.layer_norm.default" in _ops(last)  # the final norm is after the layers
    held = holders([first, last], pp=2)
    assert held["wte.weight"] == (0, 1)  # read by the embedding and by the head
    assert held["ln_f.weight"] == (1,) and held["wpe.weight"] == (0,)
    # the tied weight is read where it is used, not sent
    assert "wte.weight" in first.params and "wte.weight" in last.params


def test_interleaved_stages_of_a_rank() -> None:
    model, (tokens,) = build("llama-tiny", batch_size=4, n_layer=4)
    mesh = autopar.Mesh((2,), ("x",), device="cpu")
    plan = autopar.plan(
        model, mesh, (tokens,), stages=2, schedule="interleaved", microbatches=2, chunks=2
    )
    assert [s.layers for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert locate(plan, 1).stages == (1, 3)
    programs = _split(model, (tokens,), plan, rank=1)
    assert [p.index for p in programs] == [0, 1, 2, 3]
    for before, after in itertools.pairwise(programs):
        assert before.sends == after.receives and before.sends


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class _Skip(nn.Module):
    """Layers, and a value from before them read by the head: it must be passed along."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        skip = h * 2
        for layer in self.layers:
            h = layer(h)
        return self.out(h + skip)


def test_a_value_read_stages_later_is_passed_along() -> None:
    torch.manual_seed(0)
    model, inputs = _Skip(), (torch.randn(4, 4),)
    mesh = autopar.Mesh((4,), ("x",), device="cpu")
    plan = autopar.plan(model, mesh, inputs, stages=4, schedule="gpipe", microbatches=1)
    programs = _split(model, inputs, plan)
    assert [s.layers for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    carried = set(programs[0].sends)
    assert len(carried) == 2  # the residual stream and the skip
    skip = next(name for name in carried if name.startswith("mul"))
    for program in programs[1:-1]:
        assert skip in program.receives and skip in program.sends
        # passed on as received (made contiguous for the wire), not recomputed
        (output,) = program.graph.find_nodes(op="output")
        sent = output.args[0][program.sends.index(skip)]
        assert sent.args[0].op == "placeholder" and sent.args[0].target == skip
    assert skip in programs[-1].receives


@pytest.mark.parametrize(
    ("rank", "header", "forward"),
    [
        (0, "pipeline stage 0 of 2", "def forward(self, idx)"),
        (3, "pipeline stage 1 of 2", "def forward(self, add_"),
    ],
)
def test_codegen_prints_the_ranks_stage_programs(
    capsys: pytest.CaptureFixture[str], rank: int, header: str, forward: str
) -> None:
    code = cli(
        [
            "codegen",
            "gpt-tiny",
            "--mesh",
            "4",
            "--device",
            "cpu",
            "--rank",
            str(rank),
            "--stages",
            "2",
            "--schedule",
            "gpipe",
            "--microbatches",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert header in out and forward in out
    assert out.count("# pipeline stage ") == 2  # the rank's header and its one program
