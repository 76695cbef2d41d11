"""Reading and writing plans as JSON or YAML, refusing other versions by name.

>>> text = dump_plan(plan, "json")          # doctest: +SKIP
>>> load_plan_text(text, "json") == plan     # doctest: +SKIP
True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from autopar_plans.errors import PlanFileError
from autopar_plans.files import PLAN_FILE, parse_json, parse_yaml, read_text
from autopar_plans.plan import PLAN_VERSION, Plan
from autopar_plans.writes import write_atomic

Format = Literal["json", "yaml"]


def dump_plan(plan: Plan, fmt: Format = "json") -> str:
    """The plan as text. JSON is stable (sorted keys) so scripts and diffs can rely on it."""
    data = plan.model_dump(mode="json")
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=True) + "\n"
    return yaml.safe_dump(data, sort_keys=True, width=100)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as YAML (``.yaml``, ``.yml``) or JSON, whole or not at all
    (``autopar_plans.writes``): a failed write leaves the old file, or none."""
    path = Path(path)
    fmt: Format = "yaml" if path.suffix in (".yaml", ".yml") else "json"
    write_atomic(path, dump_plan(plan, fmt))


def load_plan_text(text: str, fmt: Format, source: str = "<text>") -> Plan:
    """A plan from JSON or YAML text; any text ends in a plan or one ``PlanFileError``
    (size, nesting, alias and integer limits as for files: ``autopar_plans.files``)."""
    if fmt == "json":
        data = parse_json(text, source, PLAN_FILE)
    else:
        data = parse_yaml(text, source, PLAN_FILE)
    return plan_from_dict(data, source)


def load_plan(path: str | Path) -> Plan:
    """Read a plan file (``.json``, ``.yaml`` or ``.yml``)."""
    path = Path(path)
    fmt: Format = "yaml" if path.suffix in (".yaml", ".yml") else "json"
    return load_plan_text(read_text(path, PLAN_FILE), fmt, str(path))


def plan_from_dict(data: Any, source: str = "<plan>") -> Plan:
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: a plan file holds a mapping, found {type(data).__name__}")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise PlanFileError(
            f"{source}: plan version {version!r}, but this autopar reads version "
            f"{PLAN_VERSION}; re-plan the model with this version"
        )
    try:
        return Plan.model_validate(data)
    except ValidationError as err:
        raise PlanFileError(
            f"{source}: not a valid plan:\n{describe_validation_error(err)}"
        ) from None


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem, naming the field by its path (``estimate.mfu: Field required``)."""
    lines = []
    for problem in err.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        lines.append(f"  {where}: {problem['msg']}")
    return "\n".join(lines)
