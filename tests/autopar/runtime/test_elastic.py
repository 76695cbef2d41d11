"""Elastic restart (``autopar.elastic``, docs/elastic.md): a 4-rank job under ``torchrun
--max-restarts 1`` whose rank 2 is SIGKILLed before step 3 is restarted by torchrun,
resumes from the checkpoint after step 3, and ends with the parameters of an uninterrupted
run (the same loop on one process, to fp32 roundoff); the job then goes on on 2 processes
(another world size, so another plan) from the 4 processes' checkpoint, and still ends as
the uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar_examples.train import batch_at, build_model, make_optimizer

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[3]
STEPS, KILL_AT = 5, 3


def _uninterrupted(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """``steps`` steps on one process, the schedule of the first job's ``STEPS`` (the
    checkpoint carries the schedule's state, its ``T_max`` too)."""
    model = build_model(seed=0)
    optimizer, schedule = make_optimizer(model, STEPS)
    for step in range(steps):
        tokens = batch_at(step)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def _run(folder: Path, processes: int, steps: int, *kill: str) -> dict:
    """``examples/elastic_train.py`` under torchrun (one restart allowed); rank 0's record."""
    out = folder / f"final-{processes}.pt"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(processes), "--max-restarts", "1",
        "-m", "autopar_examples.elastic_train", "--steps", str(steps),
        "--checkpoint", str(folder / "ckpt"), "--out", str(out), *kill,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("elastic")


def test_a_job_that_loses_a_rank_restarts_and_ends_as_an_uninterrupted_run(folder) -> None:
    final = _run(folder, 4, STEPS, "--kill-rank", "2", "--kill-at", str(KILL_AT))
    assert final["attempt"] == 1  # torchrun restarted the group once
    assert final["start"] == KILL_AT  # from the last complete checkpoint
    assert len(final["losses"]) == STEPS - KILL_AT
    _assert_equal(final["params"], _uninterrupted())


def test_the_job_goes_on_on_another_world_size_from_the_same_checkpoint(folder) -> None:
    final = _run(folder, 2, STEPS + 2)  # 4 processes saved it; 2 resume (dp=2, not dp=4)
    assert final["attempt"] == 0 and final["start"] == STEPS
    _assert_equal(final["params"], _uninterrupted(STEPS + 2))
