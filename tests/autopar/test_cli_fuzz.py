"""Property: any argument list ends in an exit code (or argparse's own exit), never another
exception, and a plan written with ``-o`` is whole (issue 24).

Planning and the commands that trace or measure (``demo``, ``calibrate``, ``codegen``,
``explain``) are replaced by stubs, so an example takes milliseconds; what runs for real is
argparse, the mesh and ``--config`` parsing, MODEL resolution, the option checks, the hint,
plan and preset loaders, and printing and writing a plan.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import autopar
from autopar.cli import calibrate, codegen, demo, explain, main
from autopar.cli import plan as plan_command
from autopar.hints_api import options_with_hints
from autopar.model_source import resolve_factory
from autopar.options import PlanOptions
from autopar_cost_model.hardware import load_preset
from autopar_plans import Plan, load_plan

WORDS = [
    *("plan", "show", "diff", "devices", "explain", "codegen", "demo", "calibrate"),
    *("-h", "--version", "--mesh", "--cluster", "--axes", "--device", "--global-batch"),
    *("--memory", "--optimizer", "--precision", "--force", "--zero", "--stages", "--sync"),
    *("--grad-compression", "--period", "--time-limit", "--hints", "--format", "-o"),
    *("--comm", "--config", "--rank", "--plan", "--name", "--"),
    *("2", "2x2", "0", "-1", "1x", "x", "8x8x8", "99999999x99999999", "dp,tp", "dp,dp", ","),
    *("h100-sxm", "a100-80gb-sxm", "nope", "80GiB", "-5GiB", "1e309", "nan", "9" * 5000),
    *("mlp-tiny", "llama3-70b", "m.py:build", "bad.py:build", ".:x", "x:", ":", "os:sep"),
    *("n_layer=2", "=", "a=[", "bias=false", "json", "yaml", "table", "adamw", "bf16_mixed"),
    *("local_sgd", "tensor_parallel", "1f1b"),
    *("plan.json", "pickle.json", "int.json", "hints.yaml", "bomb.yaml", "garbage.yaml"),
    *("out.json", "out.yaml", "missing/out.json", "."),
]
FLAGS = [w for w in WORDS if w.startswith("-") and w not in ("-h", "--version", "--")]
FILES = st.sampled_from([w for w in WORDS if "." in w or w.endswith(":build")])
VALUE = st.sampled_from(WORDS) | st.text(max_size=5)
OPTIONS = st.lists(st.tuples(st.sampled_from(FLAGS), VALUE), max_size=4)
MESHES = st.sampled_from(["2", "2x2", "1", "0", "-2", "2x", "99999999x99999999", "x"]) | VALUE


def command(*head: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    """A subcommand's line: its fixed arguments, then options with values."""
    return st.tuples(st.tuples(*head), OPTIONS).map(
        lambda parts: [*parts[0], *(word for pair in parts[1] for word in pair)]
    )


ARGV = st.one_of(
    st.lists(st.sampled_from(WORDS) | st.text(max_size=6), max_size=12),
    command(st.just("plan"), FILES | VALUE, st.just("--mesh"), MESHES),
    command(
        st.just("plan"), st.sampled_from(["mlp-tiny", "m.py:build"]), st.just("--mesh"), MESHES
    ),
    command(st.just("show"), FILES),
    command(st.just("diff"), FILES, FILES),
    command(st.just("devices")),
)
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)
)


@pytest.fixture(scope="module")
def real_plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    from autopar_examples.models import build

    model, inputs = build("mlp-tiny")
    return autopar.plan(model, autopar.Mesh((2,), ("dp",)), inputs, name="mlp-tiny")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, real_plan: Plan) -> Iterator[Path]:
    """A folder of good and bad files the words name, with the heavy work stubbed out."""
    folder = tmp_path_factory.mktemp("cli-fuzz")
    (folder / "plan.json").write_text(real_plan.model_dump_json())
    (folder / "pickle.json").write_bytes(pickle.dumps({"version": 3}))
    (folder / "int.json").write_text('{"version": ' + "9" * 5000 + "}")
    (folder / "hints.yaml").write_text("replicate: ['layers.*.weight']\n")
    (folder / "bomb.yaml").write_text(BOMB)
    (folder / "garbage.yaml").write_bytes(bytes(range(256)))
    (folder / "m.py").write_text("def build():\n    raise RuntimeError('not called')\n")
    (folder / "bad.py").write_bytes(b"\x80\x04garbage")

    def plan_stub(model: Any, mesh: Any, inputs: Any, *, name: str, **options: Any) -> Plan:
        options_with_hints(PlanOptions.of(options))  # checks the options, reads the hints
        load_preset(mesh.device)
        return real_plan

    def build_stub(spec: str, config: Any = None, *, meta: bool = False) -> Any:
        return None, (), resolve_factory(spec)[1]

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setattr(autopar, "plan", plan_stub)
        patch.setattr(plan_command, "build_model", build_stub)
        for module in (demo, calibrate, codegen, explain):
            patch.setattr(module, "run", lambda args: 0)
        yield folder


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(argv=ARGV)
def test_any_arguments_end_in_an_exit_code(workdir: Path, argv: list[str]) -> None:
    for written in ("out.json", "out.yaml"):
        (workdir / written).unlink(missing_ok=True)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code: int | str | None = main(argv)
        except SystemExit as exit_:  # argparse's own: a bad flag, --help, --version
            code = exit_.code
    event(f"exit {code}")  # pytest --hypothesis-show-statistics: how far examples get
    assert code in (0, 2, 3), (argv, code)
    assert time.perf_counter() - start < 30.0  # no hang (not a timing: load must not fail it)
    for written in ("out.json", "out.yaml"):
        if (workdir / written).exists():
            load_plan(workdir / written)  # whole, never half-written
