"""autopar: a declarative auto-parallel compiler for PyTorch.

The public surface, in the order a user meets it:

- ``Mesh(shape, axis_names, device="h100-sxm")``: a logical device mesh; ``Mesh.cluster``
  for nodes x GPUs. Needs no processes until ``mesh.init()``.
- ``plan(model, mesh, example_inputs, ...)``: decide, offline, how to shard the model; a
  ``Plan`` (layouts, estimate, solver report) that saves to JSON/YAML.
- ``compile(model, mesh, ...)``: on every rank of a job, the model sharded as planned.
- ``trace(model, example_inputs)``: the model as an annotated ATen graph.
- ``autopar.elastic``: checkpoints a job restarted by ``torchrun --max-restarts`` resumes
  from (docs/elastic.md).
- ``autopar.optim``: LARS and LAMB on a compiled model's sharded parameters, and the
  large-batch learning-rate rules (docs/large_batch.md).
- Errors: every mistake a user can fix raises a subclass of ``AutoparError`` whose message
  says what to change.
"""

from autopar import elastic, testing
from autopar._version import __version__
from autopar.api import compile, plan
from autopar.mesh import Mesh
from autopar_passes.trace import TracedModel, trace
from autopar_plans import (
    AutoparError,
    HintError,
    InfeasiblePlanError,
    Layout,
    Partial,
    Plan,
    PlanFileError,
    PlanWarning,
    PresetError,
    Replicate,
    Shard,
    UntraceableModelError,
    UsageError,
    load_plan,
    save_plan,
)

__all__ = [
    "AutoparError",
    "HintError",
    "InfeasiblePlanError",
    "Layout",
    "Mesh",
    "Partial",
    "Plan",
    "PlanFileError",
    "PlanWarning",
    "PresetError",
    "Replicate",
    "Shard",
    "TracedModel",
    "UntraceableModelError",
    "UsageError",
    "__version__",
    "compile",
    "elastic",
    "load_plan",
    "optim",
    "plan",
    "save_plan",
    "testing",
    "trace",
]


def __getattr__(name: str) -> object:
    """``autopar.optim`` on first use: it imports DTensor (half a second), which planning
    never needs, so ``autopar plan`` does not pay for it (PEP 562)."""
    if name == "optim":
        import importlib

        return importlib.import_module("autopar.optim")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
