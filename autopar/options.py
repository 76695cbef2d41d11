"""``PlanOptions``: what ``autopar.plan`` and ``autopar.compile`` take besides model and mesh.

One typed record instead of keyword arguments threaded through every function; a mistyped
option or a bad value is refused at the door with the list of valid ones.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autopar_plans.errors import UsageError
from autopar_plans.io import describe_validation_error
from autopar_plans.mesh import MeshSpec


class PlanOptions(BaseModel):
    """Options of a plan (see ``autopar.plan``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    global_batch: int | None = Field(None, ge=1, description="Batch per optimizer step.")
    memory_limit: str | int | float | None = Field(
        None, description="Per device, such as '80GiB'; default: the preset's memory."
    )
    optimizer: Literal["sgd", "sgd_momentum", "adam", "adamw", "adafactor"] = "adamw"
    precision: Literal["fp32", "bf16_mixed", "fp16_mixed", "bf16"] = "fp32"
    force: str | None = Field(None, description="A parallel style: autopar.force.STYLES.")
    zero: Literal[0, 1, 2] | None = Field(
        None,
        description="Force a ZeRO stage for the optimizer state (0, 1 or 2); "
        "default: the fastest that fits the memory limit (ties to the lower stage).",
    )
    time_limit: float = Field(60.0, gt=0, description="Solver seconds.")
    batch_norm: Literal["sync", "per_device"] = Field(
        "sync",
        description="Training batch norms' statistics: 'sync' over the whole batch however "
        "it is split (SyncBatchNorm; equal to one device), 'per_device' over each device's "
        "slice of it (DDP's default: the batch in as many slices as the mesh has devices).",
    )
    stages: int | None = Field(None, ge=1, description="Pipeline stages (default: searched).")
    schedule: Literal["gpipe", "1f1b", "interleaved"] | None = Field(
        None, description="Pipeline schedule (default: searched)."
    )
    microbatches: int | None = Field(
        None, ge=1, description="Microbatches per step (default: searched)."
    )
    chunks: int | None = Field(None, ge=1, description="Interleaved stages per device.")
    name: str | None = Field(None, description="The model's name in the plan.")
    hints: Any = Field(
        None,
        description="A hint file (path), its parsed mapping or plans.Hints: constraints "
        "the solver plans around (docs/hints.md).",
    )

    def batch_norm_groups(self, mesh: MeshSpec) -> int:
        """How many slices of the batch a training batch norm takes statistics over."""
        return mesh.size if self.batch_norm == "per_device" else 1

    @classmethod
    def of(cls, options: dict[str, Any]) -> PlanOptions:
        try:
            return cls(**options)
        except ValidationError as error:
            raise UsageError(
                f"bad planning options:\n{describe_validation_error(error)}\n  valid options: "
                f"{', '.join(cls.model_fields)}"
            ) from None
