"""A catalogue of bad plans, paths and options handed to the CLI (``autopar.cli.main``
in-process): each ends in one line naming what is wrong, with exit code 2; and the same
plans handed to ``autopar.compile(plan=...)``; and Ctrl-C at any moment of the command
(in a subprocess: the one case that needs a real process to interrupt).

Plans are refused wherever they are read (``autopar_plans.validate``): ``show``, ``diff``,
``explain``, ``codegen --plan`` and ``compile(plan=)``. Paths to write are refused in one
line (``autopar_plans.writes``). docs/errors.md holds the same table for users.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import autopar
from autopar.cli import EXIT_USAGE, main
from autopar.mesh import Mesh
from autopar_plans import (
    Estimate,
    Layout,
    MemoryBreakdown,
    MeshSpec,
    Parallelism,
    ParamPlan,
    Plan,
    PlanFileError,
    Replicate,
    UsageError,
    dump_plan,
)

R = Replicate()
# mlp-tiny's parameters (autopar_examples.models.PRESETS)
MLP_TINY = {
    "layers.0.weight": (64, 16),
    "layers.0.bias": (64,),
    "layers.1.weight": (64, 64),
    "layers.1.bias": (64,),
    "layers.2.weight": (16, 64),
    "layers.2.bias": (16,),
}
W = "layers.0.weight"

Edit = Callable[[dict[str, Any]], None]


def good_plan(mesh: MeshSpec | None = None) -> Plan:
    """A consistent plan of mlp-tiny (every parameter replicated, no ops recorded), on
    ``mesh`` (default dp=2 x tp=2)."""
    mesh = mesh or MeshSpec((2, 2), ("dp", "tp"))
    replicated = Layout.replicated(mesh.ndim)
    return Plan(
        model="mlp-tiny",
        mesh=mesh,
        global_batch=4,
        microbatch_size=4,
        parallelism=Parallelism(),
        estimate=Estimate(
            step_time_s=1e-3,
            flops_per_step=1e6,
            mfu=0.1,
            comm_bytes_per_step=0.0,
            memory_per_device_bytes=MemoryBreakdown(total=1e5),
        ),
        params={
            name: ParamPlan(
                shape=shape,
                dtype="float32",
                param=replicated,
                grad=replicated,
                optimizer=replicated,
            )
            for name, shape in MLP_TINY.items()
        },
        ops={},
    )


def plan_data(edit: Edit | None = None) -> dict[str, Any]:
    data = json.loads(dump_plan(good_plan()))
    if edit is not None:
        edit(data)
    return data


def layouts(name: str, *placements: str, shape: list[int] | None = None) -> Edit:
    """Set parameter ``name``'s three layouts (and its shape)."""

    def edit(data: dict[str, Any]) -> None:
        entry = data["params"][name]
        for which in ("param", "grad", "optimizer"):
            entry[which] = list(placements)
        if shape is not None:
            entry["shape"] = shape

    return edit


def field(name: str, which: str, *placements: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data["params"][name][which] = list(placements)

    return edit


def renamed(old: str, new: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data["params"][new] = data["params"].pop(old)

    return edit


def top(key: str, value: Any) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data[key] = value

    return edit


def op_layout(data: dict[str, Any]) -> None:
    data["ops"]["relu"] = {
        "op": "aten.relu.default",
        "strategy": "R->R",
        "output": ["R", "R", "R"],
        "inputs": [["R", "R"]],
    }


def resized(name: str, shape: list[int]) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        data["params"][name]["shape"] = shape

    return edit


@dataclass(frozen=True)
class Case:
    """``argv``, with ``BAD`` the plan ``edit`` makes, ``GOOD`` a good plan and ``TMP`` the
    test's folder; the command exits ``code`` and stderr says ``says``."""

    id: str
    argv: list[str]
    says: str
    edit: Edit | None = None
    code: int = EXIT_USAGE


THREE_AXES = "has 3 placements but the mesh dp=2 x tp=2 (4 x h100-sxm) has 2 axes (dp, tp)"

CASES = [
    # autopar show: a plan at odds with itself
    Case("show-axes", ["show", "BAD"], f"BAD: parameter '{W}': layout [R, R, S(0)] {THREE_AXES}",
         layouts(W, "R", "R", "S(0)")),
    Case("show-dim", ["show", "BAD"], "shards dim 2 (over mesh axis 'tp'), but the parameter "
         "has shape (64, 16): dims 0..1", layouts(W, "R", "S(2)")),
    Case("show-63-rows", ["show", "BAD"], "splits dim 0 (size 63) 2 ways over mesh axis 'dp', "
         "which does not divide it", layouts(W, "S(0)", "R", shape=[63, 16])),
    Case("show-more-than-it-has", ["show", "BAD"], "splits dim 0 (size 1) 2 ways",
         layouts("layers.2.bias", "R", "S(0)", shape=[1])),
    Case("show-partial", ["show", "BAD"], "is partial over mesh axis 'dp'",
         layouts(W, "P(sum)", "R")),
    Case("show-optimizer", ["show", "BAD"], "the parameter is S(0) on mesh axis 'tp' but its "
         "optimizer-state layout is R there", lambda d: (layouts(W, "R", "S(0)")(d),
                                                         field(W, "optimizer", "R", "R")(d))),
    Case("show-gradient", ["show", "BAD"], "the gradient layout [S(0), R] is neither",
         lambda d: (field(W, "grad", "S(0)", "R")(d), field(W, "optimizer", "S(1)", "R")(d))),
    Case("show-op", ["show", "BAD"], f"op 'relu': output [R, R, R] {THREE_AXES}", op_layout),
    Case("show-batch", ["show", "BAD"], "global_batch 6 is not microbatches x microbatch_size",
         top("global_batch", 6)),
    Case("show-stage-mesh", ["show", "BAD"], "stage_mesh has axes ['pp', 'tp']",
         top("stage_mesh", {"shape": [1, 2], "axis_names": ["pp", "tp"]})),
    # autopar diff: either file
    Case("diff-second", ["diff", "GOOD", "BAD"], f"BAD: parameter '{W}': layout",
         layouts(W, "R", "R", "S(0)")),
    Case("diff-first", ["diff", "BAD", "GOOD"], "BAD: parameter 'layers.0.weight': layout",
         layouts(W, "S(0)", "R", shape=[63, 16])),
    # autopar explain: the plan, then the model it names
    Case("explain-dim", ["explain", "BAD", W], "shards dim 2", layouts(W, "R", "S(2)")),
    Case("explain-model",
         ["explain", "BAD", "layers.0.bias", "--alternatives", "--model", "mlp-tiny"],
         "BAD: parameter 'layers.0.weights' is not in the model (did you mean "
         "'layers.0.weight'?)", renamed(W, "layers.0.weights")),
    # autopar codegen --plan: the plan, the mesh, the model
    Case("codegen-axes", ["codegen", "mlp-tiny", "--mesh", "2x2", "--plan", "BAD"],
         THREE_AXES, layouts(W, "R", "R", "S(0)")),
    Case("codegen-mesh", ["codegen", "mlp-tiny", "--mesh", "4", "--plan", "GOOD"],
         "GOOD: the plan was made for the mesh dp=2 x tp=2 (4 devices), not a0=4 (4 devices)"),
    Case("codegen-names", ["codegen", "mlp-tiny", "--mesh", "2x2", "--axes", "x,y", "--plan",
                           "GOOD"], "made for the mesh dp=2 x tp=2 (4 devices), not x=2 x y=2"),
    Case("codegen-model", ["codegen", "mlp-tiny", "--mesh", "2x2", "--plan", "BAD"],
         "BAD: parameter 'fc.weight' is not in the model; the plan was made for another model "
         "('mlp-tiny') (and 1 more problem)", renamed(W, "fc.weight")),
    Case("codegen-shape", ["codegen", "mlp-tiny", "--mesh", "2x2", "--plan", "BAD"],
         "'layers.1.weight' has shape (64, 64) in the model but (64, 32) in the plan",
         resized("layers.1.weight", [64, 32])),
    Case("codegen-rank", ["codegen", "mlp-tiny", "--mesh", "2x2", "--rank", "4"],
         "--rank 4: the mesh has ranks 0..3"),
    # paths autopar cannot write
    Case("output-no-folder", ["show", "GOOD", "-o", "TMP/nonexistent/dir/plan.json"],
         "cannot write TMP/nonexistent/dir/plan.json: the folder TMP/nonexistent/dir does "
         "not exist"),
    Case("output-folder", ["show", "GOOD", "-o", "TMP"],
         "cannot write TMP: it is a folder; give a file name"),
    Case("output-under-a-file", ["show", "GOOD", "-o", "GOOD/plan.json"],
         "cannot write GOOD/plan.json: a part of GOOD is a file, not a folder"),
    Case("report-no-folder", ["show", "GOOD", "--report", "TMP/missing/report.html"],
         "cannot write TMP/missing/report.png: the folder TMP/missing does not exist"),
    Case("calibrate-under-a-file", ["calibrate", "-o", "GOOD/presets/mine.yaml"],
         "cannot write GOOD/presets/mine.yaml: a part of GOOD/presets is a file"),
    # bad options
    Case("mesh-spelling", ["plan", "mlp-tiny", "--mesh", "2y2"],
         "mesh '2y2': write sizes separated by 'x', such as 8x8"),
    Case("mesh-zero", ["plan", "mlp-tiny", "--mesh", "0x2"],
         "every axis size must be a positive integer"),
    Case("mesh-names", ["plan", "mlp-tiny", "--mesh", "2x2", "--axes", "dp"],
         "has 2 axes but 1 names"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = {"GOOD": str(tmp_path / "good.json"), "BAD": str(tmp_path / "bad.json")}
    Path(names["GOOD"]).write_text(dump_plan(good_plan()))
    Path(names["BAD"]).write_text(json.dumps(plan_data(case.edit)))
    names["TMP"] = str(tmp_path)

    def fill(text: str) -> str:
        for key, value in names.items():
            text = text.replace(key, value)
        return text

    code = main([fill(arg) for arg in case.argv])
    err = capsys.readouterr().err
    assert code == case.code, err
    assert err.startswith(f"autopar {case.argv[0]}: error: ") and err.count("\n") == 1, err
    assert fill(case.says) in err
    assert "Traceback" not in err


def test_an_unknown_option_is_argparses_usage_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as caught:
        main(["show", "plan.json", "--format", "xml"])
    assert caught.value.code == EXIT_USAGE
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_a_failed_write_leaves_the_old_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``-o`` over a good file with a bad plan: the plan is refused before anything is written."""
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(dump_plan(good_plan()))
    bad.write_text(json.dumps(plan_data(layouts(W, "R", "R", "S(0)"))))
    before = good.read_text()
    assert main(["show", str(bad), "-o", str(good)]) == EXIT_USAGE
    assert good.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "good.json"]
    capsys.readouterr()


def test_the_catalogue_is_long_enough() -> None:
    assert len(CASES) >= 20


# ---- autopar.compile(plan=...) -----------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def tiny_plan(**params: tuple[int, ...]) -> Plan:
    mesh = MeshSpec((2,), ("dp",), device="cpu")
    base = good_plan(mesh)
    entry = next(iter(base.params.values()))
    return base.model_copy(
        update={
            "params": {name: entry.model_copy(update={"shape": s}) for name, s in params.items()}
        }
    )


def compile_with(plan: Any, mesh: Mesh | None = None) -> None:
    mesh = mesh or Mesh((2,), ("dp",), device="cpu")
    autopar.compile(Tiny(), mesh, example_inputs=(torch.randn(4, 4),), plan=plan)


def test_compile_refuses_a_plan_file_at_odds_with_itself(tmp_path: Path):
    path = tmp_path / "plan.json"
    plan = tiny_plan(**{"fc.weight": (4, 4), "fc.bias": (4,)})
    data = json.loads(dump_plan(plan))
    data["params"]["fc.weight"]["param"] = ["R", "S(0)"]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"plan\.json: parameter 'fc\.weight': layout \[R"):
        compile_with(path)


def test_compile_refuses_a_plan_for_another_mesh():
    plan = tiny_plan(**{"fc.weight": (4, 4), "fc.bias": (4,)})
    with pytest.raises(PlanFileError, match=r"plan=: the plan was made for the mesh dp=2"):
        compile_with(plan, Mesh((4,), ("dp",), device="cpu"))


def test_compile_refuses_a_plan_for_another_model(monkeypatch: pytest.MonkeyPatch):
    """Checked once the model is traced (after the process groups start: stubbed here)."""
    monkeypatch.setattr(Mesh, "init", lambda self, *args, **kwargs: None)
    plan = tiny_plan(**{"fc.weight": (4, 4), "fc.bias": (4,), "head.weight": (4, 4)})
    with pytest.raises(PlanFileError, match=r"parameter 'head\.weight' is not in the model"):
        compile_with(plan)


def test_compile_refuses_a_plan_of_another_type():
    with pytest.raises(UsageError, match=r"plan=dict: pass an autopar\.Plan or the path"):
        compile_with({"model": "x"})


# ---- Ctrl-C ------------------------------------------------------------------------------

# the console script's code (pyproject.toml), under Python's own Ctrl-C handler whatever
# the test runner set for its workers
CONSOLE = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from autopar_entry import main; sys.exit(main())"
)


def loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def interrupt(after: Callable[[int], bool], then: float = 0.0) -> tuple[int, str]:
    """Start ``autopar plan`` (a long one), wait for ``after(pid)`` and ``then`` seconds
    more, send SIGINT; the exit code and stderr."""
    child = subprocess.Popen(
        [sys.executable, "-c", CONSOLE, "plan", "llama3-8b", "--mesh", "8x8"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not after(child.pid) and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.005)
        time.sleep(then)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    return child.returncode, err


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
@pytest.mark.parametrize(
    ("moment", "then"),
    [("while torch is imported", 0.0), ("while the model is traced and planned", 2.5)],
)
def test_ctrl_c_at_any_moment_exits_130_with_one_line(moment: str, then: float):
    code, err = interrupt(lambda pid: loaded(pid, "libtorch"), then)
    assert (code, err) == (130, "autopar: interrupted\n"), moment
