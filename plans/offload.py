"""The offload policy: which training state lives in host memory instead of the device's.

Beside sharding, ZeRO and recomputation, the fourth way to train a model larger than device
memory is to keep what a step does not need on the device in the host's much larger memory
and move it over the device's host link (PCIe, NVLink-C2C) when it is needed:

- **optimizer** (ZeRO-Offload, Ren et al. 2021, arXiv 2101.06840): the fp32 master weights,
  their gradients and the optimizer's states live on the host and the optimizer steps there,
  on the CPU. The device keeps the working copy the graph reads (in the compute dtype under
  mixed precision) and the working gradient; each step the summed gradient goes down (in
  the dtype it was summed in) and the stepped weights come back up (in the working copy's
  dtype). Device memory for the states falls from ``w + w + (m + s)`` bytes a value to
  ``w + w``.
- **activations** (``torch.autograd.graph.save_on_cpu``; Megatron's and ZeRO-Infinity's
  activation offload): every tensor autograd saves in forward is copied to the host as it is
  saved and back when backward unpacks it; the device holds none of a microbatch's saved
  activations between its forward and backward.

Parameter offload (ZeRO-Infinity's, each layer's weights fetched one layer ahead) is not
built yet.

``Offload`` is what a plan does (``Plan.offload``); ``OffloadRequest`` what the user allows
or forces for each kind (``auto``: the planner decides under the memory limit).
"""

from __future__ import annotations

from itertools import product
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Choice = Literal["auto", "on", "off"]
Purpose = Literal["optimizer", "activations"]
Direction = Literal["to_host", "to_device"]
KINDS: tuple[str, ...] = ("optimizer", "activations")


class Offload(BaseModel):
    """What a plan keeps in host memory (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    optimizer: bool = False
    activations: bool = False

    @property
    def active(self) -> bool:
        return self.optimizer or self.activations

    def describe(self) -> str:
        """In words: 'optimizer states and activations', or 'nothing'."""
        kinds = [k for k in KINDS if getattr(self, k)]
        words = {"optimizer": "optimizer states", "activations": "activations"}
        return " and ".join(words[k] for k in kinds) or "nothing"


NO_OFFLOAD = Offload()


class HostCopy(BaseModel):
    """The copies of one purpose and direction a step makes between a device and its host
    (``Estimate.host``): the runtime's ``HostLog`` counts the same bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    purpose: Purpose
    direction: Direction
    stage: int = Field(0, ge=0, description="The pipeline stage whose devices copy (0 without).")
    bytes: float = Field(ge=0, description="Bytes per step (every microbatch's together).")
    calls: int | None = Field(
        None,
        ge=0,
        description="Copies per step, where the plan knows them (one per parameter piece "
        "for the optimizer; activations: one per saved tensor, not counted ahead).",
    )
    seconds: float = Field(0.0, ge=0, description="Time on the host link, hidden or not.")
    exposed_s: float = Field(0.0, ge=0, description="The part of it the step waits for.")


class OffloadRequest(BaseModel):
    """Per kind: ``on`` (forced), ``off`` (forbidden) or ``auto`` (the planner's choice)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    optimizer: Choice = "auto"
    activations: Choice = "auto"

    def candidates(self) -> list[Offload]:
        """The policies allowed, the cheapest first: none before one kind before both,
        optimizer (its copies once a step) before activations (theirs every microbatch)."""
        options = [
            (False, True) if getattr(self, k) == "auto" else (getattr(self, k) == "on",)
            for k in KINDS
        ]
        found = [Offload(**dict(zip(KINDS, flags, strict=True))) for flags in product(*options)]
        return sorted(
            found, key=lambda o: (sum(map(int, (o.optimizer, o.activations))), o.activations)
        )

    @property
    def forced(self) -> bool:
        return any(getattr(self, k) == "on" for k in KINDS)


AUTO_OFFLOAD = OffloadRequest()


def offload_request(value: object) -> OffloadRequest:
    """The request an option or hint spells: ``auto``; ``none`` / ``off``; a kind or a
    comma-separated list of kinds (forced on, the others off); or a mapping of kind to
    ``on`` / ``off`` / ``auto`` (booleans read as on / off). ``ValueError`` says what is
    wrong."""
    if value is None or value == "auto":
        return AUTO_OFFLOAD
    if isinstance(value, OffloadRequest):
        return value
    if isinstance(value, Offload):
        return OffloadRequest(**{k: "on" if getattr(value, k) else "off" for k in KINDS})
    if isinstance(value, str):
        if value in ("none", "off"):
            return OffloadRequest(optimizer="off", activations="off")
        kinds = [k.strip() for k in value.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(
                f"offload {value!r}: expected auto, none, or kinds out of {', '.join(KINDS)} "
                "(comma-separated)"
            )
        return OffloadRequest(**{k: "on" if k in kinds else "off" for k in KINDS})
    if isinstance(value, dict):
        unknown = [k for k in value if k not in KINDS]
        if unknown:
            raise ValueError(f"offload: unknown kind {unknown[0]!r}; kinds are {', '.join(KINDS)}")
        spelled = {}
        for kind, given in value.items():
            choice = ("on" if given else "off") if isinstance(given, bool) else given
            if choice not in ("auto", "on", "off"):
                raise ValueError(f"offload.{kind}: {given!r}; one of auto, on, off")
            spelled[kind] = choice
        return OffloadRequest(**spelled)
    raise ValueError(f"offload: expected a string or a mapping, got {type(value).__name__}")
