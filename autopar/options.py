"""``PlanOptions``: what ``autopar.plan`` and ``autopar.compile`` take besides model and mesh.

One typed record instead of keyword arguments threaded through every function; a mistyped
option or a bad value is refused at the door with the list of valid ones.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autopar_plans.compression import SCHEMES, GradCompression
from autopar_plans.errors import UsageError
from autopar_plans.io import describe_validation_error
from autopar_plans.mesh import MeshSpec
from autopar_plans.offload import OffloadRequest, offload_request
from autopar_plans.reduction import GradReduction


class PlanOptions(BaseModel):
    """Options of a plan (see ``autopar.plan``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    global_batch: int | None = Field(None, ge=1, description="Batch per optimizer step.")
    memory_limit: str | int | float | None = Field(
        None, description="Per device, such as '80GiB'; default: the preset's memory."
    )
    optimizer: Literal["sgd", "sgd_momentum", "adam", "adamw", "adafactor", "lars", "lamb"] = (
        "adamw"
    )
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
    grad_compression: str | dict[str, Any] | None = Field(
        None,
        description="Compress the data-parallel gradient sum (opt-in: it changes the "
        f"numbers): a scheme ({', '.join(SCHEMES)}) or a mapping of "
        "autopar_plans.compression.GradCompression's fields (docs/communication.md).",
    )
    sync: Literal["every_step", "local_sgd"] = Field(
        "every_step",
        description="'local_sgd': sum no gradients; average the parameters every "
        "`period` optimizer steps after `sync_warmup` synchronous ones (post-local SGD).",
    )
    period: int = Field(1, ge=1, description="local_sgd: optimizer steps between averagings.")
    sync_warmup: int = Field(0, ge=0, description="local_sgd: synchronous steps first.")
    reduction_form: Literal["auto", "per_axis", "hierarchical"] = Field(
        "auto",
        description="How a gradient sum over several mesh axes runs: one all-reduce per "
        "axis, or hierarchical (reduce-scatter inside, all-reduce across, all-gather "
        "inside); 'auto': the cheaper under the cost model.",
    )
    offload: str | dict[str, Any] | None = Field(
        None,
        description="What may live in host memory instead of the device's: 'auto' (the "
        "default: the planner offloads where the memory limit calls for it), 'none', "
        "kinds forced on (optimizer, activations, parameters: 'optimizer,activations'; "
        "parameters needs the optimizer and forces it on too), or a mapping kind -> on / "
        "off / auto (autopar_plans.offload; docs/offload.md).",
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

    def grad_reduction(self) -> GradReduction:
        """The gradient-reduction policy these options ask for (its form still ``auto``
        when so given: the planner resolves it)."""
        found = self.grad_compression
        try:
            if isinstance(found, str):
                compression = GradCompression(scheme=found)  # type: ignore[arg-type]
            else:
                compression = GradCompression(**(found or {}))
        except ValidationError as error:
            raise UsageError(
                f"bad grad_compression:\n{describe_validation_error(error)}\n  schemes: "
                f"{', '.join(SCHEMES)}"
            ) from None
        return GradReduction(
            form=self.reduction_form,
            compression=compression,
            sync=self.sync,
            period=self.period,
            warmup=self.sync_warmup,
        )

    def offload_request(self) -> OffloadRequest:
        """What these options allow or force to live in host memory."""
        try:
            return offload_request(self.offload)
        except ValueError as error:
            raise UsageError(f"bad offload option: {error}") from None

    @classmethod
    def of(cls, options: dict[str, Any]) -> PlanOptions:
        try:
            return cls(**options)
        except ValidationError as error:
            raise UsageError(
                f"bad planning options:\n{describe_validation_error(error)}\n  valid options: "
                f"{', '.join(cls.model_fields)}"
            ) from None
