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

- **parameters** (ZeRO-Infinity, Rajbhandari et al. 2021, arXiv 2104.07857: its
  ``offload_param``): the working copy of every parameter lives on the host too; every
  microbatch each layer's working copies come up as the layer runs, prefetched one layer
  ahead, in forward and again in backward, and are dropped after use. The device holds no
  parameter between uses, only its gradient and the copies of about two layers at a time.
  It needs the optimizer offloaded (as DeepSpeed's ``offload_param`` needs ZeRO-3 with a
  CPU optimizer, and FSDP2's ``CPUOffloadPolicy`` moves both) and plans with ZeRO stage 0:
  a ZeRO axis would have to gather the masters on the host. The layouts the planner
  chooses (FSDP, tensor parallelism) shard the copies as they shard the parameters.

``Offload`` is what a plan does (``Plan.offload``); ``OffloadRequest`` what the user allows
or forces for each kind (``auto``: the planner decides under the memory limit).
"""

from __future__ import annotations

from itertools import product
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Choice = Literal["auto", "on", "off"]
Purpose = Literal["optimizer", "activations", "parameters"]
Direction = Literal["to_host", "to_device"]
# (a new kind goes last: requests and plans spell the kinds by name, messages list them)
KINDS: tuple[str, ...] = ("optimizer", "activations", "parameters")
WORDS = {"optimizer": "optimizer states", "activations": "activations", "parameters": "parameters"}
NEEDS_OPTIMIZER = (
    "parameter offload needs the optimizer offloaded too (the master each working copy is "
    "cast from lives on the host): set optimizer to on or auto, or parameters to off"
)


class Offload(BaseModel):
    """What a plan keeps in host memory (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    optimizer: bool = False
    activations: bool = False
    parameters: bool = False

    @model_validator(mode="after")
    def _parameters_need_optimizer(self) -> Offload:
        if self.parameters and not self.optimizer:
            raise ValueError(NEEDS_OPTIMIZER)
        return self

    @property
    def active(self) -> bool:
        return any(getattr(self, k) for k in KINDS)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in KINDS if getattr(self, k))

    def describe(self) -> str:
        """In words: 'optimizer states and activations', 'optimizer states, activations
        and parameters', or 'nothing'."""
        words = [WORDS[k] for k in self.kinds]
        if len(words) <= 1:
            return "".join(words) or "nothing"
        return f"{', '.join(words[:-1])} and {words[-1]}"


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
        "for the optimizer; parameters: one per working copy and fetch; activations: one "
        "per saved tensor, not counted ahead).",
    )
    seconds: float = Field(0.0, ge=0, description="Time on the host link, hidden or not.")
    exposed_s: float = Field(0.0, ge=0, description="The part of it the step waits for.")


class OffloadRequest(BaseModel):
    """Per kind: ``on`` (forced), ``off`` (forbidden) or ``auto`` (the planner's choice)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    optimizer: Choice = "auto"
    activations: Choice = "auto"
    parameters: Choice = "auto"

    @model_validator(mode="after")
    def _parameters_need_optimizer(self) -> OffloadRequest:
        if self.parameters == "on" and self.optimizer == "off":
            raise ValueError(NEEDS_OPTIMIZER)
        return self

    def candidates(self) -> list[Offload]:
        """The policies allowed, the cheapest first (ties go to the first: less offload).

        Without parameters before with: parameter offload moves every working copy over
        the host link twice a microbatch to free only the working copies, the most traffic
        for the least memory, so it comes after every policy without it (ZeRO-Infinity's
        last resort too). Within each, fewer kinds first, and the optimizer (its copies
        once a step) before activations (theirs every microbatch): none; optimizer;
        activations; both; optimizer and parameters; all three. Parameters never come
        without the optimizer, which holds their masters."""
        options = [
            (False, True) if getattr(self, k) == "auto" else (getattr(self, k) == "on",)
            for k in KINDS
        ]
        spelled = [dict(zip(KINDS, flags, strict=True)) for flags in product(*options)]
        found = [Offload(**s) for s in spelled if s["optimizer"] or not s["parameters"]]
        return sorted(found, key=lambda o: (o.parameters, len(o.kinds), o.activations))

    @property
    def forced(self) -> bool:
        return any(getattr(self, k) == "on" for k in KINDS)


AUTO_OFFLOAD = OffloadRequest()


def offload_request(value: object) -> OffloadRequest:
    """The request an option or hint spells: ``auto``; ``none`` / ``off``; a kind or a
    comma-separated list of kinds (forced on, the others off); or a mapping of kind to
    ``on`` / ``off`` / ``auto`` (booleans read as on / off). ``parameters`` on forces the
    optimizer on too (it needs it), unless the optimizer is spelled ``off``: then
    ``ValueError`` says so, as it says what else is wrong.

    >>> offload_request("parameters").optimizer
    'on'
    """
    if value is None or value == "auto":
        return AUTO_OFFLOAD
    if isinstance(value, OffloadRequest):
        return value
    if isinstance(value, Offload):
        return OffloadRequest(**{k: "on" if getattr(value, k) else "off" for k in KINDS})
    if isinstance(value, str):
        if value in ("none", "off"):
            return OffloadRequest(**dict.fromkeys(KINDS, "off"))
        kinds = [k.strip() for k in value.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(
                f"offload {value!r}: expected auto, none, or kinds out of {', '.join(KINDS)} "
                "(comma-separated)"
            )
        if "parameters" in kinds:
            kinds.append("optimizer")  # the masters the working copies come from
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
        return OffloadRequest(**_with_optimizer(spelled))
    raise ValueError(f"offload: expected a string or a mapping, got {type(value).__name__}")


def _with_optimizer(spelled: dict[str, str]) -> dict[str, str]:
    """A mapping's choices with the optimizer forced on where parameters are (they need
    it); ``ValueError`` where it is spelled off."""
    if spelled.get("parameters") != "on":
        return spelled
    if spelled.get("optimizer") == "off":
        raise ValueError(f"offload: {NEEDS_OPTIMIZER}")
    return {**spelled, "optimizer": "on"}
