"""``autopar.Mesh``: the logical mesh (``autopar_plans.MeshSpec``) plus what a run needs.

>>> mesh = Mesh((2, 4), ("dp", "tp"), device="h100-sxm")   # no processes needed
>>> mesh.size
8
>>> Mesh.cluster(nodes=16, gpus_per_node=8).describe()
'node=16 x gpu=8 (128 x h100-sxm)'

Under ``torchrun`` (or ``torch.multiprocessing`` with a process group), ``mesh.init()``
builds the process groups with ``init_device_mesh``: NCCL on CUDA, gloo on CPU; it starts
the default group from torchrun's environment when the script has not.
``Mesh.from_device_mesh`` takes a ``DeviceMesh`` the script built itself.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pydantic import PrivateAttr
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar_plans.errors import UsageError
from autopar_plans.mesh import MeshSpec

# what torchrun (and torch.distributed's env:// rendezvous) puts in each process's environment
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def local_rank() -> int:
    """This process's device on its node: ``LOCAL_RANK`` as torchrun sets it, else the
    global rank modulo the node's CUDA devices."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0


def _init_default_group(backend: str, timeout_s: float | None) -> None:
    """The default process group from torchrun's environment, its store keys under this
    restart's own prefix: under ``torchrun --max-restarts`` the agent's store outlives a
    failed attempt, and the keys the dead workers left (their gloo addresses) sent the
    next attempt's workers to connect to ports nobody listens on (pytorch issue 167288)."""
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    store, rank, world = next(
        iter(dist.rendezvous("env://", timeout=timeout or timedelta(minutes=30)))
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"autopar/attempt-{attempt}/", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def with_timeout(device_type: str, ndim: int, timeout_s: float | None) -> dict[int, Any] | None:
    """``init_device_mesh``'s per-axis backend options that set the groups' timeout."""
    if not timeout_s:
        return None
    backend = "nccl" if device_type == "cuda" else "gloo"
    options: Any = (
        dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    )
    options._timeout = timedelta(seconds=timeout_s)
    return {axis: (backend, options) for axis in range(ndim)}


class Mesh(MeshSpec):
    """A device mesh: shape, axis names, hardware preset. See ``autopar_plans.MeshSpec``."""

    # the ``DeviceMesh`` this mesh was made from, if any (``from_device_mesh``)
    _device_mesh: DeviceMesh | None = PrivateAttr(default=None)

    def runtime_device_type(self) -> str:
        """``"cuda"`` when the default process group runs NCCL on CUDA devices, else ``"cpu"``
        (gloo). The preset only says what the plan is costed for: a plan for H100s can be
        tried out on CPU ranks."""
        if self._device_mesh is not None:
            return self._device_mesh.device_type
        if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return "cuda"
        return "cpu"

    def init(self, timeout_s: float | None = None) -> DeviceMesh:
        """The process groups for this mesh: the ``DeviceMesh`` it was made from
        (``from_device_mesh``), else one built with ``init_device_mesh``.

        Under ``torchrun`` with no process group yet, the default group is started from
        the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), as
        ``init_device_mesh`` does: NCCL where CUDA is, else gloo. On CUDA each process
        takes the device ``LOCAL_RANK`` names. Raises ``UsageError`` when there is no
        process group and no launcher's environment, or when the mesh's size is not the
        world size.
        """
        if not dist.is_available():
            raise UsageError("this build of torch has no torch.distributed")
        if not dist.is_initialized():
            missing = [key for key in LAUNCH_ENV if key not in os.environ]
            if missing:
                raise UsageError(
                    "the mesh needs a process group: launch with torchrun (the environment "
                    f"lacks {', '.join(missing)}), or call "
                    "torch.distributed.init_process_group first"
                )
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(local_rank())
            _init_default_group("nccl" if cuda else "gloo", timeout_s)
        world = dist.get_world_size()
        if world != self.size:
            raise UsageError(
                f"the mesh {self.describe()} has {self.size} devices but the job has "
                f"{world} processes; launch {self.size} processes or change the mesh shape"
            )
        if self._device_mesh is not None:
            return self._device_mesh
        device_type = self.runtime_device_type()
        if device_type == "cuda":
            torch.cuda.set_device(local_rank())
        return init_device_mesh(
            device_type,
            self.shape,
            mesh_dim_names=self.axis_names,
            backend_override=with_timeout(device_type, self.ndim, timeout_s),
        )

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh, device: str | None = None) -> Mesh:
        """The mesh of a ``DeviceMesh`` the script already built (``init_device_mesh``):
        its shape and axis names, costed for the preset ``device`` (default: ``"cpu"`` for
        a CPU mesh, else the ``MeshSpec`` default); ``init`` then returns that mesh."""
        names = device_mesh.mesh_dim_names
        options: dict[str, object] = {"shape": tuple(device_mesh.shape)}
        if names is not None:
            options["axis_names"] = tuple(names)
        if device is not None:
            options["device"] = device
        elif device_mesh.device_type == "cpu":
            options["device"] = "cpu"
        mesh = cls(**options)
        mesh._device_mesh = device_mesh
        return mesh

    @classmethod
    def from_spec(cls, spec: MeshSpec) -> Mesh:
        return cls(**spec.model_dump())
