"""The errors autopar raises on bad input, one class per kind of mistake.

Every message says what was wrong and what to do. The CLI maps each class to an exit code
(see ``autopar.cli``) and prints the message alone, never a stack trace.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base class: a problem the user can fix, described in the message."""


class UsageError(AutoparError):
    """A wrong argument: a mesh, a MODEL string, example inputs, a config value."""


class PlanFileError(AutoparError):
    """A plan file that cannot be read: another version, a missing or malformed field."""


class PresetError(AutoparError):
    """An unknown hardware preset, or a preset file that is missing a field."""


class UntraceableModelError(AutoparError):
    """The model could not be traced by ``torch.export``; the message names module and line."""


class InfeasiblePlanError(AutoparError):
    """No plan fits the constraints (memory limit, hints); the message says what would help."""


class HintError(AutoparError):
    """A hint file that does not match the model or the mesh; names file, line and hint."""


class PlanWarning(UserWarning):
    """Something the plan does that the user may not expect (an op replicated for want of a
    sharding rule, a solve stopped at its time limit): each of ``Plan.warnings``, issued
    through ``warnings.warn`` when a plan is made, so that ``warnings.filterwarnings``
    and ``pytest -W error`` see it."""
