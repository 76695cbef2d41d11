"""When a rank fails, every other rank says which one and why.

Without help, a rank that raises or is killed leaves the others blocked in their next
collective until gloo notices the closed socket ("Connection closed by peer", 20-74 s
later) or the process group's timeout (30 minutes by default), each with a traceback that
names neither the rank nor its error. So, as torchrun's elastic agent records a worker's
error file, each rank here:

- **records its own error** in the job's store (the rendezvous ``TCPStore`` every rank
  already talks to) before the exception leaves an autopar call, or leaves the script
  (``sys.excepthook``): ``autopar/error/<rank>``;
- **registers where it runs** (``autopar/where/<rank>``: host and pid), so that a rank
  killed without a word (SIGKILL, the out-of-memory killer) can be named by a survivor on
  the same host;
- **explains a failed collective**: when a collective raises (a closed connection, a
  timeout), the rank reads the store and raises one ``RankFailedError`` naming the failed
  rank and its message; a rank that timed out marks itself, waits a moment for the others
  to do the same, and names those that never reached the collective (stuck ranks).

The collectives run under ``Faults.guard`` (``runtime.comm.AxisGroup.call``); the
compiled model's entry points under ``Faults.reporting``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from autopar_plans.errors import AutoparError

DEFAULT_TIMEOUT_S = 600.0  # a collective waits this long before its rank gives up
# what a collective's error says when a peer is gone or too slow (gloo and NCCL)
_COMM_SIGNS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "socket",
    "peer",
    "nccl",
)
_GRACE_S = 2.0  # how long a timed-out rank waits for the others to mark themselves
_LINGER_S = 10.0  # how long rank 0 keeps the store up for the others to read it


class Waitable(Protocol):
    """An async collective's handle (``torch.distributed.Work``, ``GuardedWork``)."""

    def wait(self) -> bool: ...


class RankFailedError(AutoparError):
    """Another rank of the job failed, was killed or is stuck; the message says which."""


def is_comm_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing for want of a peer (not a bug of this
    rank's own: a shape error raises here too, and is this rank's to report)."""
    if isinstance(error, AutoparError) or not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(sign in text for sign in _COMM_SIGNS)


def _error_key(rank: int) -> str:
    return f"autopar/error/{rank}"


def _where_key(rank: int) -> str:
    return f"autopar/where/{rank}"


def _explained_key(rank: int) -> str:
    return f"autopar/explained/{rank}"


def _timed_out_key(rank: int) -> str:
    return f"autopar/timed_out/{rank}"


def _reached_key(rank: int) -> str:
    return f"autopar/reached/{rank}"


class Faults:
    """This rank's side of the job's fault reports (module docstring)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self._recorded = False
        self._set(_where_key(self.rank), f"{socket.gethostname()}:{os.getpid()}")
        for key in (_error_key, _reached_key, _explained_key, _timed_out_key):  # earlier ones
            with contextlib.suppress(RuntimeError, OSError):
                self.store.delete_key(key(self.rank))

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    # ---- this rank's own error --------------------------------------------------------
    def record(self, error: BaseException) -> None:
        """Leave ``error`` in the store for the other ranks (the first only)."""
        if self._recorded or isinstance(error, RankFailedError) or is_comm_error(error):
            return
        self._recorded = True
        self._set(_error_key(self.rank), f"{type(error).__name__}: {error}"[:2000])

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Record any error of this rank's that leaves the block (a compiled model's call)."""
        try:
            yield
        except BaseException as error:
            self.record(error)
            raise

    def install_excepthook(self) -> None:
        """Record an error that leaves the script (the user's own code failing between
        autopar's calls), then let Python report it as usual."""
        previous = sys.excepthook

        def hook(
            kind: type[BaseException], error: BaseException, trace: TracebackType | None
        ) -> None:
            self.record(error)
            previous(kind, error, trace)

        sys.excepthook = hook

    # ---- another rank's ---------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a collective's failure into a ``RankFailedError`` that says why."""
        try:
            yield
        except RuntimeError as error:
            if not is_comm_error(error):
                raise
            raise self.explain(error, what) from None

    def explain(self, error: BaseException, what: str) -> RankFailedError:
        """The failure of collective ``what`` explained from the store: the ranks that
        recorded an error, those killed on this host, and those that never reached a
        collective (each rank whose collective failed marks itself, then waits a moment
        for the others to do the same)."""
        timed_out = "time" in str(error).lower()
        self._set(_reached_key(self.rank), "1")
        if timed_out:
            self._set(_timed_out_key(self.rank), "1")
        try:
            time.sleep(_GRACE_S)
            errors = self._found(_error_key)
            dead = self._dead()
            reached = self._found(_reached_key)
            # a rank whose peer gave up on a timeout and left sees a closed connection: it
            # is a timeout all the same
            timed_out = timed_out or bool(self._found(_timed_out_key))
        except (RuntimeError, OSError) as gone:  # the store is gone: its host, rank 0, is
            return RankFailedError(
                f"rank {self.rank}: {what} failed and the job's store (on rank 0) is gone: "
                f"rank 0 died or was killed ({str(gone).splitlines()[0][:200]})"
            )
        dead = [r for r in dead if r not in errors]  # one that failed, then exited
        # a rank blocked beside a failed one fails in turn once its own peers give up:
        # only a timeout says a rank that never reached a collective is stuck
        stuck = [
            r
            for r in range(self.world)
            if timed_out
            and r != self.rank
            and r not in reached
            and r not in errors
            and r not in dead
        ]
        self._linger(set(errors) | set(dead))
        lines = [f"rank {r} failed: {message}" for r, message in sorted(errors.items())]
        lines += [f"rank {r} was killed (its process is gone; no error recorded)" for r in dead]
        lines += [
            f"rank {r} did not reach the collective within {self.timeout_s:g} s (stuck?)"
            for r in stuck
        ]
        if not lines:
            lines = [
                f"the collective timed out after {self.timeout_s:g} s and no rank recorded an error"
                if timed_out
                else "a peer closed its connection and no rank recorded an error (a rank "
                "on another host was killed, or lost its network)"
            ]
        if timed_out:
            lines[-1] += (
                f" (autopar.compile(..., timeout=) sets how long a collective waits: "
                f"{self.timeout_s:g} s now)"
            )
        return RankFailedError(
            f"rank {self.rank} stopped: {what} failed because " + "; ".join(lines)
        )

    def _linger(self, gone: set[int]) -> None:
        """Say this rank has read the store; rank 0, whose process holds the store, waits
        (a few seconds at most) for the other ranks still up to read it too, since its
        exit takes the store down with it."""
        self._set(_explained_key(self.rank), "1")
        if self.rank != 0:
            return
        waiting = [r for r in range(1, self.world) if r not in gone]
        deadline = time.monotonic() + _LINGER_S
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not self.store.check([_explained_key(r)])]
            time.sleep(0.05)

    def _found(self, key: Callable[[int], str]) -> dict[int, str]:
        found = {}
        for rank in range(self.world):
            if rank != self.rank and self.store.check([key(rank)]):
                found[rank] = self.store.get(key(rank)).decode(errors="replace")
        return found

    def _dead(self) -> list[int]:
        """Ranks on this host whose process is gone."""
        host = socket.gethostname()
        dead = []
        for rank, where in self._found(_where_key).items():
            name, _, pid = where.rpartition(":")
            if name == host and pid.isdigit() and not _alive(int(pid)):
                dead.append(rank)
        return dead

    def _set(self, key: str, value: str) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            self.store.set(key, value)


def fingerprints(tensors: list[Any]) -> Any:
    """One float64 number per tensor that differs, in practice, when its values, their
    order or its shape differ: the values weighted by their position (a plain sum misses
    a shuffled batch), plus the shape. Cheap: one pass over each tensor."""
    found = []
    for given in tensors:
        tensor = given.detach() if given.requires_grad else given
        # on the tensor's own device: only the sum comes back to the host
        flat = tensor.double().reshape(-1).nan_to_num(0.0, 1e300, -1e300)
        weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device)
        weights.remainder_(1009).add_(1)
        shape = sum((i + 1) * 1e6 * size for i, size in enumerate(tensor.shape))
        found.append(float((flat * weights).sum()) + shape)
    return torch.tensor(found, dtype=torch.float64)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a child that exited but was not reaped yet is a zombie: gone as far as the job goes
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def guarded_call(
    faults: Faults | None, what: str, fn: Callable[..., Any], *args: Any, **kw: Any
) -> Any:
    """``fn(*args, **kw)`` (a ``torch.distributed`` collective) under ``faults.guard``; a
    returned ``Work`` waits under it too."""
    if faults is None:
        return fn(*args, **kw)
    with faults.guard(what):
        result = fn(*args, **kw)
    if isinstance(result, dist.Work):
        return GuardedWork(result, faults, what)
    return result


class GuardedWork:
    """An async collective's handle whose ``wait`` explains a failure (``Faults.guard``)."""

    def __init__(self, work: dist.Work, faults: Faults, what: str) -> None:
        self._work = work
        self._faults = faults
        self._what = what

    def wait(self) -> bool:
        with self._faults.guard(self._what):
            return bool(self._work.wait())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
