"""The compiled model under ``torchrun``, as users launch training (gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.autopar.runtime.features import adamw, cross_entropy, make
from tests.autopar.runtime.torchrun_train import STEPS

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[3]


def single_device() -> tuple[list[float], torch.nn.Module]:
    model, inputs, target = make("gpt-tiny")
    optimizer = adamw(model)
    losses = []
    for _ in range(STEPS):
        loss = cross_entropy(model(*inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model


def test_training_under_torchrun_matches_single_device(tmp_path: Path) -> None:
    out = tmp_path / "losses.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(Path(__file__).with_name("torchrun_train.py")), str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    losses, model = single_device()
    assert result["world"] == 2
    assert result["losses"] == pytest.approx(losses, rel=1e-4)
    assert result["state_keys"] == list(model.state_dict())
    assert result["names"] == [name for name, _ in model.named_parameters()]
