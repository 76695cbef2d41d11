"""``python -m benchmarks`` renders BENCHMARKS.md from its records (no timing is asserted)."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks import render
from benchmarks.__main__ import main

HEADERS = [
    "## Machine",
    "## Trace time on the meta device",
    "## Planning speed",
    "## Plan quality against hand-written parallelism",
    "## Memory frontier: ZeRO, recomputation and offload against step time",
    "## Pipeline search",
    "## Runtime on real ranks",
    "## GPU (H200)",
]


def test_gpu_section_is_read_from_the_saved_h200_files(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    main(["--only", "gpu", "--out", str(out), "--results", str(tmp_path / "results")])
    text = out.read_text()
    for header in HEADERS:
        assert text.count(header) == 1, header
    assert "Met: 0.826x (peak memory 1.000x)" in text  # compiled vs eager on the H200
    assert "padded to a multiple of 8 rows" in text  # the lm_head of vocab 50257
    assert "6.4 ms against 4.5 ms predicted" in text
    assert "| GPU kernels | 395.5 ms | 339.7 ms | -55.8 ms |" in text  # read off its profile
    assert "| 50257 | 1 | 34.075 ms (99 TFLOP/s) |" in text  # matmul_alignment.txt
    assert "| 50264 | 0 | 4.752 ms (710 TFLOP/s) |" in text
    assert "Command: `python -m benchmarks" in text or "`python -m benchmarks --only gpu" in text
    assert (tmp_path / "results" / "gpu.json").exists()


def test_regenerating_keeps_the_mixture_of_experts_section(tmp_path):
    old = "# Benchmarks\n\nold text\n\n## Mixture-of-experts\n\nexpert figures\n\n## Other\n\nx\n"
    first = render.document({}, old)
    assert first.count("## Mixture-of-experts") == 1 and "expert figures" in first
    assert "old text" not in first
    added = first.replace(render.MOE_SLOT, render.MOE_SLOT + "\n\nmore expert figures")
    second = render.document({}, added)
    assert second.count("## Mixture-of-experts") == 1
    assert "expert figures" in second and "more expert figures" in second
    assert second.index("more expert figures") < second.index("## Memory frontier")


def _record(data):
    machine = {"cpu": "cpu", "cores": 2, "memory_gib": 1, "os": "os", "python": "3", "torch": "t"}
    return {"command": "python -m benchmarks", "date": "today", "machine": machine, "data": data}


def test_a_plan_slower_than_a_baseline_is_flagged_not_hidden():
    entry = {
        "status": "ok", "step_s": 1.0, "mfu": 0.5, "plan_s": 1.0, "dp": 8, "tp": 1, "pp": 1,
        "sp": 1, "zero": 0, "schedule": "none", "chunks": 1, "microbatches": 1,
        "microbatch": 8, "recompute": [],
    }  # fmt: skip
    faster = dict(entry, step_s=0.8, mfu=0.625)
    case = {
        "model": "m", "devices": 8, "mesh": "1x8", "global_batch": 8, "autopar": entry,
        "ddp": copy.deepcopy(entry), "fsdp": faster, "megatron": {"status": "does not fit"},
        "megatron_grid": [],
    }  # fmt: skip
    case["autopar_at_baseline_batch"] = dict(entry, step_s=0.7, mfu=0.71, example_batch=4)
    text = render.quality(_record({"cases": [case]}))
    assert "**Missed** in m on 1x8 against FSDP (ZeRO-3) (1.250)" in text
    assert "autopar/this 1.250 **LOSS**" in text and "autopar/this 1.000)" in text
    assert "Planned again with example inputs of 4 sequences" in text
    assert "ratio 0.875." in text


def test_a_stopped_quality_run_renders_the_cases_it_finished_marked_partial(tmp_path):
    entry = {
        "status": "ok", "step_s": 1.0, "mfu": 0.5, "plan_s": 1.0, "dp": 8, "tp": 1, "pp": 1,
        "sp": 1, "zero": 0, "schedule": "none", "chunks": 1, "microbatches": 1,
        "microbatch": 8, "recompute": [],
    }  # fmt: skip
    case = {
        "model": "m", "devices": 8, "mesh": "1x8", "global_batch": 8, "autopar": entry,
        "ddp": copy.deepcopy(entry), "fsdp": copy.deepcopy(entry),
        "megatron": {"status": "does not fit"}, "megatron_grid": [],
    }  # fmt: skip
    results = tmp_path / "results"
    results.mkdir()
    record = _record({"cases": [case], "seconds": 1.0}) | {"section": "quality", "partial": True}
    (results / "quality.partial.json").write_text(json.dumps(record))
    out = tmp_path / "BENCHMARKS.md"
    main(["--render", "--out", str(out), "--results", str(results)])
    text = out.read_text()
    section = text[text.index("## Plan quality") : text.index("## Memory frontier")]
    assert "**Partial record**: the run was stopped after 1 of its cases" in section
    assert "| m | 1x8 | 8 |" in section


def _h200_record(**step: float) -> dict:
    from pathlib import Path

    saved = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200"
    gpu = json.loads((saved / "gpu.json").read_text())
    gpu["step"].update(step)
    return _record({"gpu": gpu, "check_nccl": "check", "files": ["gpu.json"]})


def test_the_gpu_verdict_follows_the_figures():
    """The ratio judged is the alternating pairs' when recorded, else the two runs one after
    the other: within 5% is met, beyond is a miss; a run made before a fix says so."""
    old = _h200_record(compiled_s=0.4014, eager_s=0.3721, ratio=1.079)
    old["data"]["gpu"] |= {"side_by_side": None, "fused_projection": False}
    old["data"]["gpu"] |= {"aligned_linear": False, "profile": None}
    text = render.gpu(old)
    assert "**Missed**: 1.079x" in text
    assert "its rows are not 16-byte aligned in bf16." in text
    assert "alternating pairs" not in text
    assert "not measured on a GPU yet" in text
    record = _h200_record()
    record["data"]["gpu"]["side_by_side"] |= {"ratio": 1.02}
    text = render.gpu(record)
    assert "Met: 1.020x (peak memory 1.000x)" in text
    assert "| step time (median of 10) | 371.6 ms | 313.3 ms | 0.843 |" in text
    assert "not measured on a GPU yet" not in text


def test_a_mixture_of_experts_case_shows_its_expert_parallel_baseline_and_kept_cases_say_when():
    """The EP x DP column holds the forced expert-parallel plan (``ep 8`` in its layout),
    a dense model's cell is ``-``; a case a ``--resume`` run kept names its own run."""
    entry = {
        "status": "ok", "step_s": 1.0, "mfu": 0.5, "plan_s": 1.0, "dp": 64, "tp": 1, "pp": 1,
        "sp": 1, "zero": 3, "schedule": "none", "chunks": 1, "microbatches": 16,
        "microbatch": 64, "recompute": [], "ep": 8,
    }  # fmt: skip
    moe = {
        "model": "moe", "devices": 64, "mesh": "8x8", "global_batch": 1024, "autopar": entry,
        "ep_dp": dict(entry, step_s=1.25, mfu=0.4, zero=1), "megatron_grid": [],
        "commit": "new",
    }  # fmt: skip
    dense = dict(moe, model="dense", ep_dp=None, commit="old", date="yesterday", kept=True)
    text = render.quality(_record({"cases": [moe, dense]}))
    row = next(line for line in text.splitlines() if line.startswith("| moe | 8x8 | 1024 |"))
    assert "1.25 s, 40.0% (autopar/this 0.800)" in row
    assert "dp 64 tp 1 pp 1 ep 8 zero 1, 16 x 64" in text
    dense_row = next(line for line in text.splitlines() if line.startswith("| dense | 8x8 |"))
    assert "| - |" in dense_row
    assert "`--resume`): dense on 8x8 (run yesterday, commit old)." in text
    assert "moe on 8x8 (run" not in text


def test_a_quick_quality_run_plans_every_baseline_of_a_dense_and_an_moe_model(tmp_path):
    """``--quick`` plans gpt-tiny and moe-tiny against every baseline (no timing asserted):
    the expert-parallel one only for the mixture of experts, where it fits."""
    out = tmp_path / "BENCHMARKS.md"
    main(["--quick", "--only", "quality", "--out", str(out), "--results", str(tmp_path / "r")])
    text = out.read_text()
    times = [line for line in text.splitlines() if "tiny | 1x" in line and "| 16 |" in line]
    dense, moe = sorted(times)  # the step-time table's rows (global batch 16)
    assert dense.count("autopar/this") == 4 and "| - |" in dense  # no EP x DP cell
    assert moe.count("autopar/this") == 5
    assert " ep 4" in text  # the EP x DP plan splits moe-tiny's 4 experts over 4 devices
    # autopar at or under every baseline, on one node: the Megatron grid's best there cuts
    # pipeline stages inside the node (dp 4 x pp 2), so autopar's search must cut there too
    assert "Met in every case." in text


def test_extra_quality_cases_run_after_the_runs_own_once_each(monkeypatch):
    from benchmarks import quality

    ran = []
    monkeypatch.setattr(quality, "run_case", lambda model, devices: ran.append((model, devices)))
    quality.run(quick=True, extra=[("gpt3-13b", 64), ("gpt-tiny", 8)])
    assert ran == [*quality.QUICK_CASES, ("gpt3-13b", 64)]  # gpt-tiny@8 is already one


def test_a_resumed_run_plans_again_only_the_cases_named_again(monkeypatch, tmp_path):
    from benchmarks import quality

    entry = {
        "status": "ok", "step_s": 1.0, "mfu": 0.5, "plan_s": 1.0, "dp": 4, "tp": 1, "pp": 1,
        "sp": 1, "zero": 0, "schedule": "none", "chunks": 1, "microbatches": 1,
        "microbatch": 4, "recompute": [],
    }  # fmt: skip

    def case(model, devices, commit):
        return {
            "model": model, "devices": devices, "mesh": f"1x{devices}", "global_batch": 4,
            "autopar": entry, "ddp": entry, "fsdp": entry, "megatron": entry,
            "megatron_grid": [], "commit": commit,
        }  # fmt: skip

    ran = []
    monkeypatch.setattr(quality, "run_case", lambda m, d: ran.append((m, d)) or case(m, d, "new"))
    results = tmp_path / "results"
    results.mkdir()
    old = [case(m, d, "old") for m, d in quality.QUICK_CASES]
    (results / "quality.json").write_text(json.dumps(_record({"cases": old})))
    out = tmp_path / "BENCHMARKS.md"
    again = ["--again", "moe-tiny@4", "--results", str(results), "--out", str(out)]
    main(["--only", "quality", "--quick", "--resume", *again])
    assert ran == [("moe-tiny", 4)]
    cases = json.loads((results / "quality.json").read_text())["data"]["cases"]
    assert [(c["model"], c["commit"]) for c in cases] == [("gpt-tiny", "old"), ("moe-tiny", "new")]


def test_again_without_resume_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--only", "quality", "--again", "gpt3-13b@64"])
    assert "use it with --resume" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("gpt3-13b", "write MODEL@DEVICES"),
        ("gpt5@64", "write MODEL@DEVICES"),
        ("gpt3-13b@12", "12 devices are no cluster of 8-GPU nodes"),
    ],
)
def test_a_bad_extra_case_is_refused_with_the_form_to_use(case, words, capsys):
    with pytest.raises(SystemExit):
        main(["--only", "quality", "--cases", case])
    assert words in capsys.readouterr().err


def test_the_gpu_run_under_a_memory_limit_says_whether_its_peak_kept_within():
    record = _h200_record()
    limited = {
        "limit_bytes": 30 * 2**30, "unlimited_planned_bytes": 45 * 2**30,
        "planned_bytes": 29 * 2**30, "recomputed_regions": 3, "recomputed_layers": [0, 1],
        "predicted_s": 0.3, "step_s": 0.4, "peak_bytes": 28 * 2**30,
    }  # fmt: skip
    record["data"]["gpu"]["memory_limited"] = limited
    text = render.gpu(record)
    assert "Under a memory limit of 30.00 GiB" in text
    assert "recomputes 3 regions in 2 layers" in text and "within the limit" in text
    limited["peak_bytes"] = 31 * 2**30
    assert "**over** the limit" in render.gpu(record)
