"""Elastic restart (``autopar.elastic``, docs/elastic.md): a 4-rank job under ``torchrun
--max-restarts 1`` whose rank 2 is SIGKILLed before step 3 is restarted by torchrun,
resumes from the checkpoint after step 3, and ends with the parameters of an uninterrupted
run (the same loop on one process, to fp32 roundoff)."""

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


def _uninterrupted() -> dict[str, torch.Tensor]:
    model = build_model(seed=0)
    optimizer, schedule = make_optimizer(model, STEPS)
    for step in range(STEPS):
        tokens = batch_at(step)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def test_a_job_that_loses_a_rank_restarts_and_ends_as_an_uninterrupted_run(tmp_path) -> None:
    out = tmp_path / "final.pt"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", "4", "--max-restarts", "1",
        "-m", "autopar_examples.elastic_train", "--steps", str(STEPS),
        "--checkpoint", str(tmp_path / "ckpt"), "--kill-rank", "2", "--kill-at", str(KILL_AT),
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = torch.load(out, weights_only=False)
    assert final["attempt"] == 1  # torchrun restarted the group once
    assert final["start"] == KILL_AT  # from the last complete checkpoint
    assert len(final["losses"]) == STEPS - KILL_AT
    want = _uninterrupted()
    assert set(final["params"]) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(final["params"][name], value, rtol=1e-5, atol=1e-6)
