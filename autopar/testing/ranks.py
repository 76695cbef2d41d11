"""Run a function on N local processes joined by a gloo process group.

>>> results = run_ranks(work, world_size=4, args=("gpt-tiny",))   # doctest: +SKIP

``work(rank, world_size, *args)`` runs in each process after ``init_process_group``; its
return value (picklable) comes back in rank order. A failure in any rank raises here with
that rank's traceback text.

Each rank is a new process with no process group, as under ``torchrun``, and sees the
caller's environment as it is at the call. The processes are forked from a
``forkserver`` that has imported torch and autopar's runtime once (``PRELOAD``): a
spawned interpreter spends about two seconds importing them, and four ranks on two cores
took 5-7 s to start where a fork takes 0.1 s. The server is started by the first call and
serves the calling process's later calls.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import socket
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# imported once by the forkserver, so every rank starts with them; a module that is not
# installed (transformers is a test dependency) is skipped by the server
PRELOAD = (
    "torch.distributed",
    "autopar.runtime.compiled",
    "autopar_examples.models",
    "transformers.modeling_utils",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    rank: int,
    world_size: int,
    port: int,
    outdir: str,
    work: Callable[..., Any],
    args: Sequence[Any],
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the forkserver's environment is the one it started with
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # what the forkserver imported is never garbage: a full collection (compile runs one)
    # then walks only what the work makes, 0.05 s instead of 0.25-0.6 s
    gc.freeze()
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        result = work(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start(
    work: Callable[..., Any], world_size: int, args: Sequence[Any], outdir: str, join: bool
) -> Any:
    """Start ``world_size`` ranks of ``work`` writing their records to ``outdir``, from the
    forkserver where there is one; ``join``: wait (torch ends every rank once one fails)."""
    start_method = "spawn"
    if "forkserver" in multiprocessing.get_all_start_methods():  # not on Windows
        start_method = "forkserver"
        multiprocessing.set_forkserver_preload(list(PRELOAD))
    return mp.start_processes(
        _entry,
        args=(world_size, free_port(), outdir, work, tuple(args), dict(os.environ)),
        nprocs=world_size,
        join=join,
        start_method=start_method,
    )


def run_ranks(work: Callable[..., Any], world_size: int, args: Sequence[Any] = ()) -> list[Any]:
    """Run ``work`` on ``world_size`` gloo ranks; return their results in rank order."""
    with tempfile.TemporaryDirectory() as outdir:
        # a failing rank's own traceback is in its file; read below
        with contextlib.suppress(mp.ProcessRaisedException, mp.ProcessExitedException):
            _start(work, world_size, args, outdir, join=True)
        results = []
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} died without a result")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                if record.get("autopar") is not None:
                    raise record["autopar"]
                raise RuntimeError(f"rank {rank} failed:\n{record['error']}")
            results.append(record["result"])
        return results


def run_ranks_outcomes(
    work: Callable[..., Any], world_size: int, args: Sequence[Any] = (), wait_s: float = 300.0
) -> list[dict[str, Any]]:
    """As ``run_ranks``, but a rank that fails or dies does not stop the others (torch's
    ``join`` terminates every rank once one fails): for fault tests. Per rank, in order:
    ``{"ok": True, "result": ...}``, ``{"ok": False, "error": traceback}``, or
    ``{"ok": False, "died": exitcode}`` (killed, or no result)."""
    with tempfile.TemporaryDirectory() as outdir:
        context = _start(work, world_size, args, outdir, join=False)
        assert context is not None
        for process in context.processes:
            process.join(wait_s)
            if process.is_alive():
                process.kill()
                process.join()
        outcomes = []
        for rank, process in enumerate(context.processes):
            path = os.path.join(outdir, f"rank{rank}.pt")
            if not os.path.exists(path):
                outcomes.append({"ok": False, "died": process.exitcode})
                continue
            record = torch.load(path, weights_only=False)
            outcomes.append(record)
        return outcomes
