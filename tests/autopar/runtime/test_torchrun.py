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


def _flat(history: list) -> list[float]:
    """(loss, norm) per step, laid end to end."""
    return [value for step in history for value in step]


def _torchrun(*script: str, processes: int = 2) -> None:
    """Run ``script`` (a file or ``-m module``, with its arguments) on ``processes``."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(processes),
        *script,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_example_training_script_matches_one_device_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """examples/train.py as a user runs it: no process group of its own (compile starts it
    from torchrun's environment), a Hugging Face Llama called with labels, clipping, a
    cosine schedule, a DCP checkpoint after step 2 that a second job resumes from, and
    greedy generation in eval mode at the end."""
    from autopar_examples.train import build_model, continue_prompt, train

    checkpoint, first, second = tmp_path / "ckpt", tmp_path / "a.json", tmp_path / "b.json"
    common = ["-m", "autopar_examples.train", "--mesh", "2", "--steps", "4"]
    _torchrun(*common, "--checkpoint", str(checkpoint), "--save-at", "2", "--out", str(first))
    _torchrun(*common, "--checkpoint", str(checkpoint), "--resume", "2", "--out", str(second))
    trained = json.loads(first.read_text())
    resumed = json.loads(second.read_text())
    model = build_model()
    alone = train(model, 4)
    assert trained["world"] == 2
    assert min(norm for _, norm in alone) > 0.5  # clipping acts on every step
    assert _flat(trained["history"]) == pytest.approx(_flat(alone), rel=1e-5)
    assert _flat(resumed["history"]) == pytest.approx(_flat(trained["history"][2:]), rel=1e-5)
    # Hugging Face's generate on one device, and the compiled model's, after the same steps
    assert trained["generated"] == resumed["generated"] == continue_prompt(model)


def test_the_example_training_script_on_one_process_is_the_loop_without_autopar(
    tmp_path: Path,
) -> None:
    """A job of one process compiles for a mesh of one device: the same steps and tokens."""
    from autopar_examples.train import build_model, continue_prompt, train

    out = tmp_path / "one.json"
    _torchrun("-m", "autopar_examples.train", "--mesh", "1", "--steps", "3", "--out", str(out),
              processes=1)  # fmt: skip
    ran = json.loads(out.read_text())
    model = build_model()
    alone = train(model, 3)
    assert ran["world"] == 1
    assert _flat(ran["history"]) == pytest.approx(_flat(alone), rel=1e-5)
    assert ran["generated"] == continue_prompt(model)


def test_training_onto_the_scripts_own_device_mesh_matches_single_device(
    tmp_path: Path,
) -> None:
    out = tmp_path / "losses.json"
    _torchrun(str(Path(__file__).with_name("torchrun_train.py")), str(out))
    result = json.loads(out.read_text())
    losses, norms, model = single_device()
    assert result["world"] == 2
    assert result["given_mesh_used"]
    assert min(norms) > MAX_NORM  # clipping acts
    assert result["norms"] == pytest.approx(norms, rel=1e-5)
    assert result["losses"] == pytest.approx(losses, rel=1e-4)
    assert result["state_keys"] == list(model.state_dict())
    assert result["names"] == [name for name, _ in model.named_parameters()]
