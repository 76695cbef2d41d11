"""``autopar calibrate``'s host (``autopar_cost_model.calibrate.calibrate_host``): the
optimizer step measured on the CPU, the copies measured where a GPU exists and kept from
the base preset where none does, and the figures carried through the preset file.

The device figures are stubbed and the budget tiny, so that these run in a second; no
timing is asserted, only that a figure was measured and where each figure came from."""

from __future__ import annotations

import pytest
import torch

import autopar_cost_model.calibrate as cal
from autopar_cost_model.hardware import load_preset, save_preset

TINY = cal.Budget(
    seconds=0.01,
    max_matmul=64,
    copy_bytes=1 << 16,
    comm_bytes=1 << 12,
    comm_iters=1,
    host_step_values=1 << 14,
    host_copy_bytes=1 << 16,
)


@pytest.fixture
def calibrated(monkeypatch: pytest.MonkeyPatch) -> cal.Calibration:
    """``calibrate(quick=True)`` on the CPU with the device's figures stubbed: only the host
    is measured, on the tiny budget."""
    figures = cal.DeviceFigures(
        peaks={"float32": 1e11},
        memory_bandwidth=1e10,
        op_forward=1e-6,
        op_backward=1e-6,
        op_rates={},
        reference_step_s=0.01,
    )
    monkeypatch.setattr(cal, "QUICK", TINY)
    monkeypatch.setattr(cal, "measure_device", lambda *args, **kwargs: figures)
    return cal.calibrate(name="tiny", quick=True, collectives=False, device="cpu")


def test_the_calibrated_preset_carries_the_measured_host_step(calibrated):
    host = calibrated.preset.host
    assert host is not None
    assert host.optimizer_bandwidth is not None and host.optimizer_bandwidth > 0
    assert host.memory_bytes == cal.machine_memory()
    assert any(
        note.startswith("host: optimizer_bandwidth: an AdamW step") for note in calibrated.notes
    )


def test_on_a_cpu_the_link_is_the_base_presets_and_the_summary_says_so(calibrated):
    base = load_preset("cpu").host
    host = calibrated.preset.host
    assert base is not None and host is not None
    for field in ("memory_bandwidth", "to_device", "from_device", "latency", "efficiency"):
        assert getattr(host, field) == getattr(base, field), field
    rows = dict(cal.summary_rows(calibrated.preset, calibrated.host_link_source))
    assert "not measured (no GPU): cpu's" in rows["host to device"]
    assert "not measured" in rows["device to host"]
    assert "adamw" in rows["host optimizer step"]
    assert any(note.startswith("host link: not measured") for note in calibrated.notes)


def test_the_host_round_trips_through_the_preset_file(calibrated, tmp_path):
    path = save_preset(calibrated.preset, tmp_path / "tiny.yaml", "\n".join(calibrated.notes))
    loaded = load_preset(path)
    assert loaded.host == calibrated.preset.host
    assert "optimizer_bandwidth:" in path.read_text()


def test_with_a_gpu_the_measured_copies_replace_the_link_at_efficiency_one(monkeypatch):
    """The GPU path's bookkeeping, its copies stubbed (``measure_host_copies`` itself runs
    where a GPU is: ``test_host_copies_on_a_gpu``)."""
    monkeypatch.setattr(cal, "measure_host_copies", lambda device, budget: (21.5e9, 24.5e9))
    base = load_preset("h100-sxm")
    assert base.host is not None
    notes: list[str] = []
    found = cal.calibrate_host(torch.device("cuda:0"), TINY, base, notes)
    assert found.link_source == "measured"
    assert (found.link.to_device, found.link.from_device) == (21.5e9, 24.5e9)
    assert found.link.efficiency == 1.0
    assert found.link.latency == base.host.latency
    assert any("host link: pinned copies" in note for note in notes)


def test_copies_that_fail_keep_the_base_link_and_say_why(monkeypatch):
    def fail(device: torch.device, budget: cal.Budget) -> tuple[float, float]:
        raise RuntimeError("CUDA error: out of memory\nmore lines")

    monkeypatch.setattr(cal, "measure_host_copies", fail)
    base = load_preset("h100-sxm")
    notes: list[str] = []
    found = cal.calibrate_host(torch.device("cuda:0"), TINY, base, notes)
    assert found.link.to_device == base.host.to_device  # type: ignore[union-attr]
    assert found.link_source == "not measured (copies failed): h100-sxm's"
    assert any("copies failed (CUDA error: out of memory)" in note for note in notes)


def test_a_machine_that_does_not_say_its_memory_keeps_the_bases(monkeypatch):
    def unknown(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(cal.os, "sysconf", unknown)
    assert cal.machine_memory() is None
    base = load_preset("cpu")
    found = cal.calibrate_host(torch.device("cpu"), TINY, base, [])
    assert found.link.memory_bytes == base.host.memory_bytes  # type: ignore[union-attr]


def test_a_base_without_a_host_is_its_own_host():
    base = load_preset("cpu").model_copy(update={"host": None})
    found = cal.calibrate_host(torch.device("cpu"), TINY, base, [])
    assert found.link.memory_bandwidth == base.memory_bandwidth
    assert found.link.to_device == base.memory_bandwidth * base.efficiency.memory / 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies between host and a GPU")
def test_host_copies_on_a_gpu():
    to_device, from_device = cal.measure_host_copies(torch.device("cuda:0"), TINY)
    assert to_device > 0 and from_device > 0
