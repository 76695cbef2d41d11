"""``autopar.Mesh`` at run time: where its process groups come from."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import autopar
from autopar.mesh import LAUNCH_ENV, local_rank
from autopar_plans import UsageError


def test_without_a_process_group_or_a_launcher_the_mesh_says_how_to_launch(monkeypatch):
    assert not dist.is_initialized()
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(UsageError, match=r"launch with torchrun .*RANK, WORLD_SIZE"):
        autopar.Mesh((2,), ("dp",), device="cpu").init()


def test_the_local_device_is_the_one_torchrun_names(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert local_rank() == 0  # no process group: the first device
