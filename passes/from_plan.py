"""Read a plan's decisions back onto a traced graph, for the lowering.

The lowering always works from a ``autopar_plans.Plan`` (fresh from the solver or loaded from a
file), so a saved plan and a new one take the same path. Each op's strategy is found among
the candidates its rule offers by the layouts the plan recorded; a plan made for another
model or mesh is refused with a message naming the first node that does not match.

User inputs are whole (replicated) by default. With ``local_inputs`` each one instead
arrives in the layout most of its consumers take it in (``input_layouts``), so a rank can
be handed only its slice of the batch.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Mapping

from autopar_passes.annotation import META_KEY
from autopar_passes.strategies.graph import tensor_inputs, traced_choices
from autopar_passes.strategies.types import Strategy
from autopar_passes.trace import TracedModel
from autopar_plans.errors import PlanFileError
from autopar_plans.placement import REPLICATE, Layout, Partial
from autopar_plans.plan import Plan


class PlanLayouts:
    """Strategy of every op and layout of every output, as a plan decided them."""

    def __init__(self, traced: TracedModel, plan: Plan, *, local_inputs: bool = False) -> None:
        self.strategies: dict[str, Strategy] = {}
        self.layouts: dict[tuple[str, int], Layout] = {}
        # a pipeline plan's layouts are on one stage's mesh
        mesh_shape = (plan.stage_mesh or plan.mesh).shape
        choices, _ = traced_choices(traced, mesh_shape)
        for info in traced.params.values():
            if info.name not in plan.params:
                raise PlanFileError(
                    f"the plan has no layout for parameter {info.name!r}; "
                    "it was made for another model"
                )
            for node in info.nodes:
                self.layouts[(node, 0)] = plan.params[info.name].param
        replicated = Layout.replicated(len(mesh_shape))
        for node in traced.graph.nodes:
            note = node.meta[META_KEY]
            if node.op == "placeholder":
                self.layouts.setdefault((node.name, 0), replicated)
                continue
            if node.op != "call_function" or not note.outputs:
                continue
            if node.target is operator.getitem:
                parent = node.args[0]
                self.layouts[(node.name, 0)] = self.layouts[(parent.name, int(node.args[1]))]
                continue
            recorded = plan.ops.get(node.name)
            if recorded is None:
                raise PlanFileError(
                    f"the plan has no strategy for op {node.name} "
                    f"({note.op}); it was made for another model"
                )
            strategy = next(
                (
                    s
                    for s in choices[node.name].strategies
                    if s.inputs == recorded.inputs and s.outputs[0] == recorded.output
                ),
                None,
            )
            if strategy is None:
                raise PlanFileError(
                    f"op {node.name} ({note.op}): the plan's strategy "
                    f"{recorded.strategy} is not one this model offers; "
                    "re-plan the model"
                )
            self.strategies[node.name] = strategy
            for index, layout in enumerate(strategy.outputs):
                self.layouts[(node.name, index)] = layout
        self.inputs = input_layouts(traced, self.strategies, len(mesh_shape))
        if local_inputs:
            for name, layout in self.inputs.items():
                self.layouts[(name, 0)] = layout

    def strategy(self, node: str) -> Strategy:
        return self.strategies[node]

    def layout(self, node: str, index: int = 0) -> Layout:
        return self.layouts[(node, index)]


def input_layouts(
    traced: TracedModel, strategies: Mapping[str, Strategy], mesh_ndim: int
) -> dict[str, Layout]:
    """For each user input, the layout most of its consumers take it in.

    Ties go to the consumer that comes first in the graph. A ``Partial`` placement (some
    rule wanting an input as summands) becomes ``Replicate``: a loader can hand a rank a
    slice, not a summand; the lowering adds the local step to the consumer that wants it.
    An input no op reads stays replicated.
    """
    wanted: dict[str, Counter[Layout]] = {name: Counter() for name in traced.user_inputs}
    for node in traced.graph.nodes:
        strategy = strategies.get(node.name)
        if strategy is None:
            continue
        for source, layout in zip(tensor_inputs(node), strategy.inputs, strict=False):
            if source.producer in wanted and layout is not None:
                whole = (REPLICATE if isinstance(p, Partial) else p for p in layout)
                wanted[source.producer][Layout(*whole)] += 1
    replicated = Layout.replicated(mesh_ndim)
    return {
        name: counts.most_common(1)[0][0] if counts else replicated
        for name, counts in wanted.items()
    }
