"""Work for ``test_faults.py``: gpt-tiny compiled data parallel on 4 gloo ranks, one of which
fails, dies or hangs; what each rank saw."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import autopar
from autopar.runtime.faults import RankFailedError
from autopar_examples.models import build
from autopar_plans.errors import AutoparError

FAILING = 2


def _compiled(timeout: float) -> tuple[Any, torch.Tensor]:
    torch.manual_seed(0)
    model, (tokens,) = build("gpt-tiny", batch_size=4)
    compiled = autopar.compile(
        model,
        autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"),
        example_inputs=(tokens,),
        force="dp",
        timeout=timeout,
    )
    return compiled, tokens


def one_rank_fails(rank: int, world: int, how: str, timeout: float) -> dict[str, Any]:
    """``how``: ``raise`` (rank 2's program raises, as a bug or an out-of-memory would),
    ``kill`` (rank 2 SIGKILLs itself), ``hang`` (rank 2 sleeps past the timeout). The
    others run a forward and backward; each returns the error it got, if any."""
    compiled, tokens = _compiled(timeout)
    start = time.perf_counter()
    try:
        if rank == FAILING:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "hang":
                time.sleep(3 * timeout + 4)
            if how == "raise":
                compiled.program.register_forward_pre_hook(_boom)
        compiled(tokens).float().sum().backward()
    except AutoparError as error:
        return {
            "type": type(error).__name__,
            "message": str(error),
            "rank_failed": isinstance(error, RankFailedError),
            "seconds": time.perf_counter() - start,
        }
    return {"type": None, "seconds": time.perf_counter() - start}


def _boom(*_: Any) -> None:
    raise ValueError("boom: a bug on this rank")


def different_batches(rank: int, world: int) -> dict[str, Any]:
    """Rank 3 is given another batch than the others (inputs='global' wants the same)."""
    compiled, tokens = _compiled(60.0)
    if rank == 3:
        tokens = tokens.flip(0)  # the same values in another order
    try:
        compiled(tokens)
    except AutoparError as error:
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None}


def pipeline_rank_killed(rank: int, world: int) -> dict[str, Any]:
    """gpt-tiny in two pipeline stages of a 2x2 mesh; rank 2 (the second stage) SIGKILLs
    itself before the step. The first stage's ranks run ``train_step``."""
    torch.manual_seed(0)
    model, (tokens,) = build("gpt-tiny", batch_size=4)
    compiled = autopar.compile(
        model,
        autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"),
        example_inputs=(tokens,),
        loss_fn=lambda logits, target: logits.float().mean() * 0 + target.float().mean(),
        force="dp",
        stages=2,
        microbatches=2,
        timeout=60,
    )
    if rank == FAILING:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        compiled.train_step(tokens, tokens)
    except AutoparError as error:
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None}
