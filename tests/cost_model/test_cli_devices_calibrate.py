"""`autopar devices` and `autopar calibrate` from the shell (subprocess), as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from autopar_cost_model import load_preset
from autopar_cost_model.hardware import PRESET_PATH_ENV


def autopar(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autopar", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_devices_prints_a_table_of_the_presets():
    result = autopar("devices")
    assert result.returncode == 0, result.stderr
    for name in ("a100-80gb-sxm", "h100-sxm", "h200-sxm", "cpu"):
        assert name in result.stdout
    assert "bf16 TFLOP/s" in result.stdout
    h100 = next(line for line in result.stdout.splitlines() if line.startswith("h100-sxm"))
    assert h100.split()[1:] == ["989.4", "79.6", "3,350.0", "450.0", "50.0", "8"]


def test_devices_as_json():
    result = autopar("devices", "--format", "json")
    assert result.returncode == 0, result.stderr
    presets = {p["name"]: p for p in json.loads(result.stdout)}
    assert presets["a100-80gb-sxm"]["peak_flops"]["bfloat16"] == 312e12
    assert presets["h200-sxm"]["memory_bandwidth"] == 4.8e12


def test_devices_lists_a_broken_user_file_by_name(tmp_path):
    (tmp_path / "broken.yaml").write_text("name: broken\n")
    env = {**os.environ, PRESET_PATH_ENV: str(tmp_path)}
    result = autopar("devices", env=env)
    assert result.returncode == 2
    assert "broken.yaml" in result.stderr and "peak_flops" in result.stderr


@pytest.mark.multirank
@pytest.mark.alone  # fits in_step to timings
def test_calibrate_quick_writes_a_preset_that_loads_back(tmp_path):
    out = tmp_path / "local.yaml"
    result = autopar("calibrate", "--quick", "--name", "tmp-machine", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    preset = load_preset(str(out))
    assert preset.name == "tmp-machine"
    assert preset.peak_flops["float32"] > 0 and preset.memory_bandwidth > 0
    assert preset.efficiency.compute == 1.0
    header = [line for line in out.read_text().splitlines() if line.startswith("#")]
    assert any("intra-node link:" in line for line in header), header
    # fitted to the reference step: its ops run slower together than alone, never 100x
    assert 0.3 < preset.in_step < 10, preset.in_step
    assert any("in_step: the reference step" in line for line in header), header
    if not torch.cuda.is_available():  # on a CPU the collectives are measured with gloo
        assert any("gloo on 2 ranks" in line for line in header), header


def test_calibrate_refuses_a_path_as_name(tmp_path):
    result = autopar(
        "calibrate",
        "--quick",
        "--skip-collectives",
        "--name",
        "a/b.yaml",
        "-o",
        str(tmp_path / "x.yaml"),
    )
    assert result.returncode == 2
    assert "--name" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="--ranks describes ranks sharing a CPU")
@pytest.mark.alone
def test_calibrate_for_ranks_sharing_the_cpu_divides_the_machine(tmp_path):
    """As ``run_ranks`` runs them: one thread a rank, the cores time-shared, the memory and
    its bandwidth split; the header says how."""
    out = tmp_path / "rank.yaml"
    result = autopar("calibrate", "--quick", "--skip-collectives", "--ranks", "2", "-o", str(out))
    assert result.returncode == 0, result.stderr
    preset = load_preset(str(out))
    cores = os.cpu_count() or 1
    header = out.read_text()
    assert f"one of 2 ranks on {cores} cores" in header
    assert "--ranks 2" in header
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert preset.memory_bytes == pytest.approx(machine / 2, rel=0.01)


def test_calibrate_refuses_ranks_below_one(tmp_path):
    result = autopar(
        "calibrate", "--quick", "--skip-collectives", "--ranks", "0", "-o", str(tmp_path / "x")
    )
    assert result.returncode == 2
    assert "ranks=0" in result.stderr
