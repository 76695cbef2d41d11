"""Hardware presets: the shipped figures, lookup by name and file, and errors that help."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from autopar_cost_model import (
    known_preset_names,
    list_presets,
    load_preset,
    preset_dirs,
    save_preset,
)
from autopar_cost_model.hardware import BUILTIN_PRESET_DIR, PRESET_PATH_ENV
from autopar_plans.errors import PresetError

# shared/REFERENCE.md, "Hardware" (vendor datasheets): bf16 dense TFLOP/s, HBM GB/s,
# NVLink GB/s bidirectional; InfiniBand HDR 25 GB/s, NDR 50 GB/s per direction per GPU.
DATASHEET = {
    "a100-80gb-sxm": (312, 2039, 600, 25),
    "h100-sxm": (989, 3350, 900, 50),
    "h200-sxm": (989, 4800, 900, 50),
}


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_shipped_gpu_presets_match_the_datasheets(name):
    bf16, hbm, nvlink, infiniband = DATASHEET[name]
    preset = load_preset(name)
    assert round(preset.peak_flops["bfloat16"] / 1e12) == bf16
    assert preset.memory_bandwidth == hbm * 1e9
    assert preset.intra_node.bandwidth == nvlink / 2 * 1e9  # per direction
    assert preset.inter_node.bandwidth == infiniband * 1e9
    assert preset.gpus_per_node == 8
    assert preset.peak_flops["bfloat16"] > preset.peak_flops["float32"]


def test_memory_capacities():
    assert load_preset("a100-80gb-sxm").memory_bytes == 80 * 2**30
    assert 79 * 2**30 < load_preset("h100-sxm").memory_bytes <= 80 * 2**30
    assert 140 * 2**30 < load_preset("h200-sxm").memory_bytes < 141 * 2**30


def test_every_shipped_preset_is_listed():
    names = [p.name for p in list_presets()]
    assert {"a100-80gb-sxm", "h100-sxm", "h200-sxm", "cpu"} <= set(names)
    assert names == sorted(names) and names == known_preset_names()


def test_unknown_name_lists_the_known_ones_closest_first():
    with pytest.raises(PresetError) as info:
        load_preset("h100")
    message = str(info.value)
    assert "'h100'" in message
    for name in ("a100-80gb-sxm", "h100-sxm", "h200-sxm", "cpu"):
        assert name in message
    assert message.index("h100-sxm") < message.index("h200-sxm") < message.index("cpu")


def write_preset(path: Path, drop: str | None = None, **changes) -> Path:
    data = yaml.safe_load((BUILTIN_PRESET_DIR / "h100-sxm.yaml").read_text())
    data.update(changes)
    if drop:
        data.pop(drop)
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_file_missing_a_field_names_the_file_and_the_field(tmp_path):
    path = write_preset(tmp_path / "broken.yaml", drop="memory_bandwidth")
    with pytest.raises(PresetError) as info:
        load_preset(str(path))
    assert str(path) in str(info.value)
    assert "memory_bandwidth" in str(info.value)
    assert "Field required" in str(info.value)


def test_a_nested_missing_field_is_named_by_its_path(tmp_path):
    path = write_preset(tmp_path / "nested.yaml", inter_node={"bandwidth": 1e9})
    with pytest.raises(PresetError, match=r"inter_node\.latency"):
        load_preset(path)


def test_misspelt_fields_and_dtypes_are_refused(tmp_path):
    with pytest.raises(PresetError, match="memory_bandwith"):
        load_preset(write_preset(tmp_path / "typo.yaml", memory_bandwith=1.0))
    with pytest.raises(PresetError, match="bf16"):
        load_preset(write_preset(tmp_path / "dtype.yaml", peak_flops={"float32": 1.0, "bf16": 2.0}))


def test_not_a_mapping_and_missing_file(tmp_path):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(PresetError, match="mapping"):
        load_preset(str(tmp_path / "list.yaml"))
    with pytest.raises(PresetError, match="no such preset file"):
        load_preset(str(tmp_path / "absent.yaml"))


def test_user_directory_adds_and_overrides_presets(tmp_path, monkeypatch):
    write_preset(tmp_path / "my-gpu.yaml", name="my-gpu", memory_bandwidth=1e12)
    write_preset(tmp_path / "h100-sxm.yaml", name="h100-sxm", memory_bandwidth=2e12)
    monkeypatch.setenv(PRESET_PATH_ENV, str(tmp_path))
    assert preset_dirs()[0] == tmp_path
    assert load_preset("my-gpu").memory_bandwidth == 1e12
    assert load_preset("h100-sxm").memory_bandwidth == 2e12  # the user's file wins
    assert "my-gpu" in known_preset_names()
    monkeypatch.delenv(PRESET_PATH_ENV)
    assert load_preset("h100-sxm").memory_bandwidth == 3.35e12


def test_a_file_must_declare_the_name_it_is_found_by(tmp_path, monkeypatch):
    write_preset(tmp_path / "alias.yaml", name="something-else")
    monkeypatch.setenv(PRESET_PATH_ENV, str(tmp_path))
    with pytest.raises(PresetError, match="something-else"):
        load_preset("alias")


def test_save_and_load_round_trip(tmp_path):
    preset = load_preset("a100-80gb-sxm").model_copy(update={"name": "copy"})
    path = save_preset(preset, tmp_path / "sub" / "copy.yaml", header="a comment\nand another")
    assert path.read_text().startswith("# a comment\n# and another\n")
    assert load_preset(path) == preset


def test_loaded_presets_are_cached_until_the_file_changes(tmp_path):
    path = write_preset(tmp_path / "cached.yaml", name="cached")
    first = load_preset(path)
    assert load_preset(path) is first
    write_preset(path, name="cached", memory_bandwidth=7e12)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert load_preset(path).memory_bandwidth == 7e12


def test_memory_may_be_written_with_a_unit(tmp_path):
    preset = load_preset(write_preset(tmp_path / "units.yaml", memory_bytes="96GiB"))
    assert preset.memory_bytes == 96 * 2**30
    with pytest.raises(PresetError, match="memory_bytes"):
        load_preset(write_preset(tmp_path / "bad.yaml", memory_bytes="lots"))
