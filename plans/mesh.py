"""The logical device mesh: a shape, a name per axis, a hardware preset.

``MeshSpec`` is pure description; it starts no processes and needs no GPUs, so a 1024-device
plan is made on a laptop. ``autopar.Mesh`` adds what only a run needs (process groups).

Which link an axis uses decides what its collectives cost. Devices are numbered row-major
over the mesh, so the last axis is the innermost. An axis whose devices (with all axes inside
it) fit in one node talks over the intra-node link (NVLink); any other axis crosses nodes.
``gpus_per_node`` says how many devices a node holds; ``None`` takes the preset's default.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from autopar_plans.errors import UsageError


class MeshSpec(BaseModel):
    """A logical device mesh. ``MeshSpec((2, 4), ("dp", "tp"))``: 8 devices, 2 x 4."""

    model_config = ConfigDict(frozen=True)

    shape: tuple[int, ...] = Field(description="Devices along each mesh axis, outermost first.")
    axis_names: tuple[str, ...] = Field(description="One unique name per mesh axis.")
    device: str = Field(default="h100-sxm", description="Hardware preset name or file.")
    gpus_per_node: int | None = Field(
        default=None, description="Devices per node; None: the preset's node size."
    )

    def __init__(
        self,
        shape: Any = None,
        axis_names: Any = None,
        /,
        **data: Any,
    ) -> None:
        if shape is not None:
            data["shape"] = shape
        if axis_names is not None:
            data["axis_names"] = axis_names
        if "shape" in data and "axis_names" not in data:
            data["axis_names"] = default_axis_names(len(tuple(data["shape"])))
        super().__init__(**data)

    @field_validator("shape", mode="before")
    @classmethod
    def _shape_is_sizes(cls, value: Any) -> Any:
        if isinstance(value, int):
            value = (value,)
        sizes = tuple(value)
        if not sizes:
            raise UsageError("a mesh needs at least one axis")
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UsageError(f"mesh shape {sizes}: every axis size must be a positive integer")
        return sizes

    @field_validator("axis_names", mode="before")
    @classmethod
    def _names_are_unique(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = (value,)
        names = tuple(value)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise UsageError(f"mesh axis names {names}: {repeated} repeated; name each axis once")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise UsageError(f"mesh axis name {name!r} must be an identifier such as 'dp'")
        return names

    @field_validator("gpus_per_node")
    @classmethod
    def _node_size_positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise UsageError(f"gpus_per_node={value}: must be a positive integer")
        return value

    @model_validator(mode="after")
    def _one_name_per_axis(self) -> MeshSpec:
        if len(self.shape) != len(self.axis_names):
            raise UsageError(
                f"mesh shape {self.shape} has {len(self.shape)} axes but "
                f"{len(self.axis_names)} names {self.axis_names}; give one name per axis"
            )
        return self

    @classmethod
    def cluster(
        cls,
        nodes: int,
        gpus_per_node: int = 8,
        device: str = "h100-sxm",
        axis_names: tuple[str, str] = ("node", "gpu"),
    ) -> MeshSpec:
        """A physical cluster: the outer axis crosses nodes, the inner axis stays inside one."""
        return cls(
            shape=(nodes, gpus_per_node),
            axis_names=axis_names,
            device=device,
            gpus_per_node=gpus_per_node,
        )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name: str) -> int:
        """The index of mesh axis ``name``."""
        if name not in self.axis_names:
            raise UsageError(
                f"unknown mesh axis {name!r}; the mesh has axes {list(self.axis_names)}"
            )
        return self.axis_names.index(name)

    def axis_size(self, name_or_index: str | int) -> int:
        index = name_or_index if isinstance(name_or_index, int) else self.axis(name_or_index)
        return self.shape[index]

    def crosses_nodes(self, axis: int, gpus_per_node: int) -> bool:
        """Whether the devices along ``axis`` sit on more than one node.

        Row-major numbering: the devices along ``axis`` are ``stride`` apart, where ``stride``
        is the product of the sizes of the axes inside it; they span ``stride * size``
        consecutive device ids, which stay in one node iff that span fits and is aligned.
        """
        inner = math.prod(self.shape[axis + 1 :])
        span = inner * self.shape[axis]
        if self.shape[axis] == 1:
            return False
        return span > gpus_per_node or gpus_per_node % span != 0

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of a global rank (row-major)."""
        if not 0 <= rank < self.size:
            raise UsageError(f"rank {rank} is outside a mesh of {self.size} devices")
        coords = []
        for size in reversed(self.shape):
            coords.append(rank % size)
            rank //= size
        return tuple(reversed(coords))

    def stage_mesh(self, stages: int) -> MeshSpec | None:
        """The mesh of one of ``stages`` pipeline stages, or None where they cannot be cut.

        Stage ``s`` holds the consecutive devices ``[s k, (s + 1) k)``, ``k = size / stages``
        (Megatron's order: the pipeline outermost). Those blocks are sub-meshes when the
        stage count takes whole axes from the outside in and then divides the next one:
        ``stages = shape[0] ... shape[j - 1] * q`` with ``q`` dividing ``shape[j]``. The
        axes taken whole keep size 1 in the stage's mesh (every name stays, so hints and
        layouts read the same), axis ``j`` keeps ``shape[j] / q``. On a cluster of nodes,
        stages that divide the node count cut across nodes; more stages cut inside them
        too.

        >>> MeshSpec((2, 8)).stage_mesh(4).shape
        (1, 4)
        >>> MeshSpec((2, 8)).stage_mesh(3) is None
        True
        """
        if stages == 1:
            return self
        left = stages
        shape = list(self.shape)
        for axis, size in enumerate(shape):
            if left == 1:
                break
            if left % size == 0:
                shape[axis], left = 1, left // size
            elif size % left == 0:
                shape[axis], left = size // left, 1
            else:
                return None
        return self.model_copy(update={"shape": tuple(shape)}) if left == 1 else None

    def stage_counts(self, most: int) -> list[int]:
        """Every pipeline stage count up to ``most`` (a model's layers) that cuts this mesh
        into stages (``stage_mesh``), 1 included."""
        return [p for p in range(1, max(most, 1) + 1) if self.stage_mesh(p) is not None]

    def no_stage_cut(self, stages: int, most: int) -> str:
        """Why ``stages`` pipeline stages cannot cut this mesh (``stage_mesh``), and the
        counts up to ``most`` (a model's layers) that can."""
        counts = ", ".join(map(str, self.stage_counts(most)))
        return (
            f"{stages} pipeline stages do not cut the mesh {self.describe()} into blocks of "
            f"consecutive devices (whole axes from the outermost, then a divisor of the "
            f"next); pick one of {counts}"
        )

    def handoff_axis(self, stages: int, boundary: int) -> int:
        """The mesh axis whose link carries the hand-off from stage ``boundary`` to the
        next (of ``stages``, the next of the last is the first: interleaving wraps round):
        the outermost axis on which the two stages' first devices differ, the slowest link
        between them."""
        per_stage = self.size // stages
        here = self.coordinates(boundary * per_stage)
        there = self.coordinates((boundary + 1) % stages * per_stage)
        return next(
            (axis for axis, (a, b) in enumerate(zip(here, there, strict=True)) if a != b), 0
        )

    def describe(self) -> str:
        dims = " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        return f"{dims} ({self.size} x {self.device})"


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """Neutral names for a mesh given only by shape: the solver, not the name, decides roles."""
    if ndim == 2:
        return ("x", "y")
    if ndim == 3:
        return ("x", "y", "z")
    return tuple(f"a{i}" for i in range(ndim))


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """Read ``"8x8"`` (or ``"2,4"``) as a mesh shape, with a clear error for anything else."""
    parts = text.replace(",", "x").lower().split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        raise UsageError(f"mesh {text!r}: write sizes separated by 'x', such as 8x8") from None
    if any(s < 1 for s in sizes):
        raise UsageError(f"mesh {text!r}: every axis size must be a positive integer")
    return sizes
