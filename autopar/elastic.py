"""Checkpoints a job restarted by ``torchrun --max-restarts`` resumes from.

Under ``torchrun --max-restarts N``, when a rank dies, torchrun stops the others and starts
the whole group again (``TORCHELASTIC_RESTART_COUNT`` counts the restarts): the script
runs from the top, so it must find where the job got to. These helpers keep sharded
checkpoints with PyTorch's own parts (``torch.distributed.checkpoint`` and its state-dict
API, as for FSDP2), one folder per step, and a ``latest`` file that names the last
*complete* one: it is written (to a temporary file, renamed) only after every rank has
finished saving, so a rank killed in the middle of a save leaves ``latest`` on the step
before. A checkpoint loads into the model compiled anew, on the same mesh or another (DCP
reshards each tensor to the new plan's layout), so a job restarted on fewer or more
devices resumes too. docs/elastic.md has the recipe.

>>> step = autopar.elastic.resume(model, optimizer, "ckpt", schedule)   # doctest: +SKIP
>>> for step in range(step, steps):                                     # doctest: +SKIP
...     train_one(step); autopar.elastic.save(model, optimizer, "ckpt", step + 1, schedule)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from autopar_plans.errors import UsageError
from autopar_plans.writes import write_atomic

LATEST = "latest"


def _folder(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def latest(root: str | Path) -> int | None:
    """The step of the last complete checkpoint under ``root``, or None."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise UsageError(f"{marker}: holds {text[:40]!r}, not a step; remove it to start afresh")
    return int(text)


def _state(model: nn.Module, optimizer: Any, schedule: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict  # 0.5 s to import

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    if schedule is not None:
        state["schedule"] = schedule.state_dict()
    return state


def save(
    model: nn.Module,
    optimizer: Any,
    root: str | Path,
    step: int,
    schedule: Any = None,
    keep: int = 2,
) -> None:
    """Save the state after ``step`` steps (collective: every rank calls it); then mark it
    the latest, and keep the ``keep`` newest checkpoints."""
    root = Path(root)
    import torch.distributed.checkpoint as dcp  # 0.5 s to import: only where used

    dcp.save(_state(model, optimizer, schedule), checkpoint_id=str(_folder(root, step)))
    dist.barrier()  # every rank's shards are written before the marker says so
    if dist.get_rank() == 0:
        write_atomic(root / LATEST, f"{step}\n")
        folders = sorted(root.glob("step-*"))
        for old in folders[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def resume(model: nn.Module, optimizer: Any, root: str | Path, schedule: Any = None) -> int:
    """Load the latest complete checkpoint under ``root`` into ``model``, ``optimizer`` and
    ``schedule`` (in place, as ``set_state_dict`` does); the steps it holds, or 0 when there
    is none (a fresh start)."""
    step = latest(root)
    if step is None:
        return 0
    state = _state(model, optimizer, schedule)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    dcp.load(state, checkpoint_id=str(_folder(Path(root), step)))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if schedule is not None:
        schedule.load_state_dict(state["schedule"])
    return step
