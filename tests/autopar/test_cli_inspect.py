"""The plan-inspection commands through a subprocess, as a user runs them: ``plan --hints
--report``, ``show``, ``explain``, ``diff``; every format; exit codes 0, 2 and 3."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autopar_plans import Plan, load_plan, save_plan
from autopar_plans.placement import Layout, Replicate, Shard, format_spec
from autopar_plans.units import format_bytes

MEGATRON = Path(__file__).resolve().parents[2] / "examples" / "hints" / "megatron.yaml"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autopar", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One hinted plan of llama-tiny on a 2x2 mesh, as JSON on stdout, a file and a report."""
    folder = tmp_path_factory.mktemp("plans")
    a = folder / "a.json"
    report = folder / "report.html"
    result = run(
        "plan",
        "llama-tiny",
        "--mesh",
        "2x2",
        "--axes",
        "dp,tp",
        "--hints",
        str(MEGATRON),
        "--format",
        "json",
        "-o",
        str(a),
        "--report",
        str(report),
    )
    assert result.returncode == 0, result.stderr
    return {
        "folder": folder,
        "a": a,
        "report": report,
        "stdout": result.stdout,
        "stderr": result.stderr,
    }


def test_plan_with_hints_prints_json_that_validates_and_honours_them(planned):
    plan = Plan.model_validate(json.loads(planned["stdout"]))
    assert plan == load_plan(planned["a"])
    assert plan.params["layers.1.attn.q_proj.weight"].param == Layout(Replicate(), Shard(0))
    assert plan.params["layers.1.mlp.down_proj.weight"].param == Layout(Replicate(), Shard(1))
    assert (plan.parallelism.dp, plan.parallelism.tp) == (2, 2)
    assert f"plan written to {planned['a']}" in planned["stderr"]  # stdout: the plan alone


def test_plan_prints_yaml():
    result = run("plan", "mlp-tiny", "--mesh", "2", "--device", "cpu", "--format", "yaml")
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate(yaml.safe_load(result.stdout))
    assert plan.mesh.shape == (2,)


def test_report_has_the_three_views_and_a_png_beside_it(planned):
    page = Path(planned["report"]).read_text()
    for anchor in ('id="timeline"', 'id="memory"', 'id="layouts"'):
        assert anchor in page
    # the three figures inline as SVG, their words as text
    assert page.count('<figure class="view"><svg role="img"') == 3
    assert "<link" not in page and "<script" not in page and "<image" not in page
    assert "layers.*.attn.q_proj.weight" in page and "[tp, None]" in page
    png = Path(planned["report"]).with_suffix(".png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert 600 <= width <= 2000 and 300 <= height <= 2000
    assert 10_000 < len(data) < 1_000_000


def test_show_prints_tables_json_and_yaml(planned):
    table = run("show", str(planned["a"]))
    assert table.returncode == 0, table.stderr
    for title in ("parallelism", "step time", "memory per device", "parameter layouts on dp, tp"):
        assert title in table.stdout
    assert "layers.*.attn.q_proj.weight" in table.stdout  # identical layers folded
    as_json = run("show", str(planned["a"]), "--format", "json")
    assert Plan.model_validate(json.loads(as_json.stdout)) == load_plan(planned["a"])
    as_yaml = run("show", str(planned["a"]), "--format", "yaml")
    assert Plan.model_validate(yaml.safe_load(as_yaml.stdout)) == load_plan(planned["a"])


def test_show_comm_prints_the_ledger_with_the_summary_totals(planned):
    plan = load_plan(planned["a"])
    assert plan.estimate.comm  # a plan without pipeline stages carries its ledger
    shown = run("show", str(planned["a"]), "--comm")
    assert shown.returncode == 0, shown.stderr
    assert "communication per step (the ledger)" in shown.stdout
    assert f"{format_bytes(plan.estimate.comm_bytes_per_step)} sent" in shown.stdout
    for kind in {entry.kind for entry in plan.estimate.comm}:
        assert kind in shown.stdout


def test_explain_names_the_hint_that_decided(planned):
    result = run(
        "explain",
        str(planned["a"]),
        "layers.0.attn.q_proj.weight",
        "--alternatives",
        "--hints",
        str(MEGATRON),
    )
    assert result.returncode == 0, result.stderr
    assert "decided by the hints" in result.stdout
    assert f'{MEGATRON}:11: shard "layers.*.attn.q_proj.weight": [tp, null]' in result.stdout
    assert "[tp, None]" in result.stdout and "hint line 11" in result.stdout


def test_explain_an_op_as_json(planned):
    result = run(
        "explain", str(planned["a"]), "layers.0.attn.o_proj", "--alternatives", "--format", "json"
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    chosen = [o for o in data["options"] if o["chosen"]]
    assert len(chosen) == 1 and data["options"][0]["chosen"]
    assert "partial(tp)" in chosen[0]["layout"]  # row-parallel: the output is a pending sum
    assert all(o["time_s"] >= chosen[0]["time_s"] - 1e-12 for o in data["options"])
    assert data["decided_by"].startswith(("cost", "the plan as a whole"))


def test_explain_answers_from_the_plan_alone_in_the_meshs_own_words(planned, tmp_path):
    """Without --alternatives nothing is traced: the plan file is enough (a model name
    autopar could not build is never looked at), the mesh axes are the plan's own, and no
    graph node name of the plan shows."""
    plan = load_plan(planned["a"])
    elsewhere = tmp_path / "unbuildable.json"
    save_plan(plan.model_copy(update={"model": "no-such-model"}), elsewhere)
    for target in ("layers.0.attn.q_proj.weight", "layers.0.attn.o_proj"):
        result = run("explain", str(elsewhere), target)
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert "dp=2 x tp=2" in out and "--alternatives" in out
        assert not set(re.findall(r"[a-z_]+_\d+", out)) & set(plan.ops)
    param = run("explain", str(elsewhere), "layers.0.attn.q_proj.weight", "--format", "json")
    rows = dict(json.loads(param.stdout)["rows"])
    chosen = plan.params["layers.0.attn.q_proj.weight"]
    assert rows["layout"] == format_spec(chosen.param, ("dp", "tp"), 2) == "[tp, None]"
    assert rows["a device holds"] == "1/2 of it"


def test_explain_alternatives_speak_the_plans_units_and_names(planned):
    """--alternatives: the chosen layout's memory is the plan's own figure per device (an
    alternative's, that figure changed), and neither the target line nor the notes name a
    graph node."""
    plan = load_plan(planned["a"])
    result = run(
        "explain", str(planned["a"]), "layers.0.attn.o_proj", "--alternatives", "--format", "json"
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    chosen = next(o for o in data["options"] if o["chosen"])
    assert chosen["memory_bytes"] == pytest.approx(plan.estimate.memory_per_device_bytes.total)
    assert data["what"] == "module layers.0.attn.o_proj's last op (aten.linear.default)"
    node = next(n for n, op in plan.ops.items() if op.module == "layers.0.attn.o_proj")
    by_node = run("explain", str(planned["a"]), node, "--alternatives", "--format", "json")
    named = json.loads(by_node.stdout)
    assert named["what"] == "op linear of layers.0.attn.o_proj (aten.linear.default)"
    words = " ".join([data["what"], *data["notes"], named["what"], *named["notes"]])
    assert not set(re.findall(r"[a-z_]+_\d+", words)) & set(plan.ops)


def test_explain_an_unknown_target_suggests_names(planned):
    result = run("explain", str(planned["a"]), "layers.0.attn.q_prj.weight")
    assert result.returncode == 2, result.stderr
    assert "closest: layers.0.attn.q_proj.weight" in result.stderr
    assert "Traceback" not in result.stderr


def test_diff_lists_parallelism_estimate_and_changed_layouts(planned):
    a = load_plan(planned["a"])
    params = dict(a.params)
    name = "layers.1.mlp.up_proj.weight"
    params[name] = params[name].model_copy(
        update={
            "param": Layout(Shard(0), Shard(0)),
            "grad": Layout(Shard(0), Shard(0)),
            "optimizer": Layout(Shard(0), Shard(0)),
        }
    )
    b = a.model_copy(
        update={
            "params": params,
            "parallelism": a.parallelism.model_copy(update={"zero": 3}),
            "estimate": a.estimate.model_copy(update={"step_time_s": 2 * a.estimate.step_time_s}),
        }
    )
    b_path = Path(planned["folder"]) / "b.yaml"
    save_plan(b, b_path)
    result = run("diff", str(planned["a"]), str(b_path))
    assert result.returncode == 0, result.stderr
    assert "parameters whose layout changed" in result.stdout
    assert "layers.1.mlp.up_proj.weight" in result.stdout and "[(dp,tp), None]" in result.stdout
    assert "+100.0%" in result.stdout  # the step time doubled
    as_json = json.loads(run("diff", str(planned["a"]), str(b_path), "--format", "json").stdout)
    assert as_json["params"] == {name: ["[tp, None]", "[(dp,tp), None]"]}
    assert as_json["parallelism"] == {"zero": [0, 3]}
    same = run("diff", str(planned["a"]), str(planned["a"]))
    assert "the parameter layouts and the parallelism are the same" in same.stdout


@pytest.mark.parametrize(
    ("text", "code", "messages"),
    [
        (
            'shard:\n  "layers.*.attn.q_prj.weight": [tp, null]\n',
            2,
            ["h.yaml:2:", "matches no parameter or module", "closest: layers.*.attn.q_proj.weight"],
        ),
        ("ban:\n  tp: [tensor_paralel]\n", 2, ["h.yaml:2: ban.tp.0"]),
        (
            "pipeline: {stages: 1}\nshard:\n"
            '  "layers.*.attn.*.weight": [tp, null]\n'
            '  "layers.*.attn.o_proj.weight": [null, tp]\n',
            3,
            [
                "these hints conflict",
                'h.yaml:3: shard "layers.*.attn.*.weight": [tp, null]',
                'h.yaml:4: shard "layers.*.attn.o_proj.weight": [null, tp]',
            ],
        ),
    ],
)
def test_hint_errors_name_file_and_line_with_their_exit_code(tmp_path, text, code, messages):
    hints = tmp_path / "h.yaml"
    hints.write_text(text)
    result = run("plan", "llama-tiny", "--mesh", "2x2", "--axes", "dp,tp", "--hints", str(hints))
    assert result.returncode == code, result.stderr
    for message in messages:
        assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "missing.json"], "no such plan file"),
        (["diff", "missing.json", "missing.json"], "no such plan file"),
        (["plan", "mlp-tiny", "--mesh", "2", "--hints", "missing.yaml"], "no such hint file"),
        (["show"], "the following arguments are required: PLAN"),
    ],
)
def test_usage_errors_exit_2(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
