"""The contract between planner and runtime: placements, layouts, meshes, plans, errors.

Pure data (pydantic); imports no ``torch.distributed`` and runs no model.
"""

from plans.errors import (
    AutoparError,
    HintError,
    InfeasiblePlanError,
    PlanFileError,
    PresetError,
    UntraceableModelError,
    UsageError,
)
from plans.io import dump_plan, load_plan, load_plan_text, plan_from_dict, save_plan
from plans.mesh import MeshSpec, default_axis_names, parse_mesh_shape
from plans.placement import (
    PARTIAL,
    REPLICATE,
    Layout,
    Partial,
    Placement,
    Replicate,
    Shard,
    format_spec,
    layout_from_spec,
    parse_placement,
    spec_from_layout,
)
from plans.plan import (
    PLAN_VERSION,
    Alternative,
    Estimate,
    MemoryBreakdown,
    OpPlan,
    Parallelism,
    ParamPlan,
    Plan,
    RecomputeRegion,
    SolverReport,
    Stage,
    StageEstimate,
)

__all__ = [
    "PARTIAL",
    "PLAN_VERSION",
    "REPLICATE",
    "Alternative",
    "AutoparError",
    "Estimate",
    "HintError",
    "InfeasiblePlanError",
    "Layout",
    "MemoryBreakdown",
    "MeshSpec",
    "OpPlan",
    "Parallelism",
    "ParamPlan",
    "Partial",
    "Placement",
    "Plan",
    "PlanFileError",
    "PresetError",
    "RecomputeRegion",
    "Replicate",
    "Shard",
    "SolverReport",
    "Stage",
    "StageEstimate",
    "UntraceableModelError",
    "UsageError",
    "default_axis_names",
    "dump_plan",
    "format_spec",
    "layout_from_spec",
    "load_plan",
    "load_plan_text",
    "parse_mesh_shape",
    "parse_placement",
    "plan_from_dict",
    "save_plan",
    "spec_from_layout",
]
