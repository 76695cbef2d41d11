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
from tests.autopar.runtime.torchrun_train import MAX_NORM, STEPS

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[3]


def single_device() -> tuple[list[float], list[float], torch.nn.Module]:
    model, inputs, target = make("gpt-tiny")
    optimizer = adamw(model)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = cross_entropy(model(*inputs), target)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, model


# autopar-mesh: the script makes no process group (compile starts it from torchrun's
# environment); device-mesh: the script's own init_device_mesh mesh is compiled onto
@pytest.mark.parametrize("mode", ["autopar-mesh", "device-mesh"])
def test_training_under_torchrun_matches_single_device(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "losses.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(Path(__file__).with_name("torchrun_train.py")), str(out), mode,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    losses, norms, model = single_device()
    assert result["world"] == 2
    assert result["given_mesh_used"]
    assert min(norms) > MAX_NORM  # clipping acts
    assert result["norms"] == pytest.approx(norms, rel=1e-5)
    assert result["losses"] == pytest.approx(losses, rel=1e-4)
    assert result["state_keys"] == list(model.state_dict())
    assert result["names"] == [name for name, _ in model.named_parameters()]
