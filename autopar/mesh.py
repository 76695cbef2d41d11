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

    def init(self) -> DeviceMesh:
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
            dist.init_process_group("nccl" if cuda else "gloo")
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
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.axis_names)

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
