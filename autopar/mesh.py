"""``autopar.Mesh``: the logical mesh (``plans.MeshSpec``) plus what a run needs.

>>> mesh = Mesh((2, 4), ("dp", "tp"), device="h100-sxm")   # no processes needed
>>> mesh.size
8
>>> Mesh.cluster(nodes=16, gpus_per_node=8).describe()
'node=16 x gpu=8 (128 x h100-sxm)'

Under ``torchrun`` (or ``torch.multiprocessing`` with a process group), ``mesh.init()``
builds the process groups with ``init_device_mesh``: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plans.errors import UsageError
from plans.mesh import MeshSpec


class Mesh(MeshSpec):
    """A device mesh: shape, axis names, hardware preset. See ``plans.MeshSpec``."""

    def runtime_device_type(self) -> str:
        """``"cuda"`` when the default process group runs NCCL on CUDA devices, else ``"cpu"``
        (gloo). The preset only says what the plan is costed for: a plan for H100s can be
        tried out on CPU ranks."""
        if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return "cuda"
        return "cpu"

    def init(self) -> DeviceMesh:
        """Build the process groups for this mesh (the default group must already exist).

        Raises ``UsageError`` when the mesh's size is not the world size.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError(
                "the mesh needs a process group: launch with torchrun, or call "
                "torch.distributed.init_process_group first"
            )
        world = dist.get_world_size()
        if world != self.size:
            raise UsageError(
                f"the mesh {self.describe()} has {self.size} devices but the job has "
                f"{world} processes; launch {self.size} processes or change the mesh shape"
            )
        device_type = self.runtime_device_type()
        if device_type == "cuda":
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.axis_names)

    @classmethod
    def from_spec(cls, spec: MeshSpec) -> Mesh:
        return cls(**spec.model_dump())
