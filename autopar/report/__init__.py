"""The plan report (``autopar plan --report``): figures drawn with matplotlib."""

from __future__ import annotations

import importlib.util

from autopar_plans.errors import UsageError


def require_matplotlib() -> None:
    """Fail before any planning, with the fix, where the report could not be drawn after it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "--report draws with matplotlib, which is not installed in this environment "
            "(autopar declares it; a partial install may lack it): pip install matplotlib"
        )
