"""The stage-cut ILP: contiguous layers onto pipeline stages.

Given per-layer costs for one microbatch (``t_l``: forward + backward seconds; ``a_l``:
saved activation bytes; ``w_l``: parameter state bytes) and those of the parts before and
after the layers, choose ``x[i, s]`` (layer ``i`` runs on stage ``s``)::

    min  sum_s T_s + (m - 1) T_max                 (GPipe and 1F1B; DESIGN.md)
    s.t. sum_s x[i, s] = 1                          every layer on one stage
         sum_s s x[i, s] <= sum_s s x[i+1, s] <= sum_s s x[i, s] + 1
                                                    contiguous, in order, no stage skipped
         x[0, 0] = 1,  x[L-1, p-1] = 1              first and last stage hold a layer each
         T_s = sum_l x[i, s] t_l + [s = 0] t_pre + [s = p-1] t_post + c_s
         T_max >= T_s
         sum_l x[i, s] (w_l + f_s a_l) + [s = 0] (w_pre + f_0 a_pre)
             + [s = p-1] (w_post + f_{p-1} a_post) <= M          memory of stage s

``f_s`` is the number of microbatches stage ``s`` holds in flight under the schedule
(``cost_model.memory.microbatches_in_flight``: m for GPipe, min(p - s, m) for 1F1B), ``c_s``
the point-to-point time of the activations stage ``s`` sends and receives, ``M`` the memory
per device. Solved with HiGHS through PuLP, as the intra-op ILP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from cost_model.memory import microbatches_in_flight
from passes.ilp import quiet_stdout
from passes.pipeline.layer_costs import LayerCosts


@dataclass(frozen=True)
class StageCut:
    """Where the stages begin and what each costs per microbatch."""

    first_layers: tuple[int, ...]  # stage s runs layers first_layers[s] .. first_layers[s+1]-1
    stage_times: tuple[float, ...]  # T_s, seconds per microbatch (forward + backward)
    stage_memory: tuple[float, ...]  # bytes per device at the peak of the step
    stage_states: tuple[float, ...]
    stage_activations: tuple[float, ...]

    def layers_of(self, stage: int, count: int) -> tuple[int, int]:
        end = self.first_layers[stage + 1] if stage + 1 < len(self.first_layers) else count
        return self.first_layers[stage], end - 1


def cut_stages(
    costs: LayerCosts,
    stages: int,
    microbatches: int,
    schedule: str,
    scale: float,
    memory_limit: float | None,
    p2p_s: Sequence[float],
    time_limit: float = 30.0,
) -> StageCut | None:
    """The best contiguous cut, or None when no cut fits the memory limit.

    ``scale`` multiplies the per-microbatch quantities (time, activations) traced for another
    microbatch size; ``p2p_s[s]`` is stage ``s``'s point-to-point time per microbatch.
    """
    count, p, m = len(costs.layers), stages, microbatches
    if p > count:
        return None
    if _identical(costs):
        return _cut_identical(costs, p, m, schedule, scale, memory_limit, p2p_s, time_limit)
    model = pulp.LpProblem("stage_cut", pulp.LpMinimize)
    x = {
        (i, s): model.add_variable(f"x_{i}_{s}", cat=pulp.LpBinary)
        for i in range(count)
        for s in range(p)
    }
    t_max = model.add_variable("t_max", lowBound=0)
    index = {i: pulp.lpSum(s * x[i, s] for s in range(p)) for i in range(count)}
    for i in range(count):
        model += pulp.lpSum(x[i, s] for s in range(p)) == 1
        if i + 1 < count:
            model += index[i] <= index[i + 1]
            model += index[i + 1] <= index[i] + 1
    model += x[0, 0] == 1
    model += x[count - 1, p - 1] == 1
    times, memories = [], []
    for s in range(p):
        held = microbatches_in_flight(schedule, p, s, m)
        time = pulp.lpSum(x[i, s] * costs.layers[i].time_s * scale for i in range(count))
        memory = pulp.lpSum(
            x[i, s] * (costs.layers[i].states + held * costs.layers[i].activations * scale)
            for i in range(count)
        )
        extra_time, extra_memory = p2p_s[s], 0.0
        if s == 0:
            extra_time += costs.pre.time_s * scale
            extra_memory += costs.pre.states + held * costs.pre.activations * scale
        if s == p - 1:
            extra_time += costs.post.time_s * scale
            extra_memory += costs.post.states + held * costs.post.activations * scale
        model += t_max >= time + extra_time
        if memory_limit is not None:
            model += memory + extra_memory <= memory_limit
        times.append(time + extra_time)
        memories.append(memory + extra_memory)
    model += pulp.lpSum(times) + (m - 1) * t_max
    with quiet_stdout():
        model.solve(pulp.HiGHS(msg=False, timeLimit=time_limit))
    if model.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    stage_of = [max(range(p), key=lambda s, i=i: x[i, s].value() or 0.0) for i in range(count)]
    firsts = tuple(stage_of.index(s) for s in range(p))
    values = [float(pulp.value(t)) for t in times]
    memory_values = [float(pulp.value(mem)) for mem in memories]
    states, acts = [], []
    for s in range(p):
        held = microbatches_in_flight(schedule, p, s, m)
        layers = [i for i in range(count) if stage_of[i] == s]
        state = sum(costs.layers[i].states for i in layers)
        act = held * scale * sum(costs.layers[i].activations for i in layers)
        if s == 0:
            state += costs.pre.states
            act += held * scale * costs.pre.activations
        if s == p - 1:
            state += costs.post.states
            act += held * scale * costs.post.activations
        states.append(state)
        acts.append(act)
    return StageCut(firsts, tuple(values), tuple(memory_values), tuple(states), tuple(acts))


def _identical(costs: LayerCosts) -> bool:
    """Whether the layers between the first and the last cost the same (the first and the
    last may differ, by what their edges to the parts around them cost: they always sit on
    the first and the last stage, so their difference goes there)."""
    if len(costs.layers) < 3:
        return False
    middle = costs.layers[1]
    return all(
        abs(part.time_s - middle.time_s) <= 1e-9 * max(middle.time_s, 1e-30)
        and abs(part.states - middle.states) <= 1e-9 * max(middle.states, 1.0)
        and abs(part.activations - middle.activations) <= 1e-9 * max(middle.activations, 1.0)
        for part in costs.layers[1:-1]
    )


def _cut_identical(
    costs: LayerCosts,
    p: int,
    m: int,
    schedule: str,
    scale: float,
    memory_limit: float | None,
    p2p_s: Sequence[float],
    time_limit: float,
) -> StageCut | None:
    """Identical layers: only how many each stage takes matters. ``n_s`` integer >= 1 with
    ``sum_s n_s = L``; the same objective and memory constraints as the general ILP, with
    ``p`` variables instead of ``L p`` (a 96-layer model on 64 stages: 64, not 6144)."""
    count = len(costs.layers)
    layer = costs.layers[1]
    first, last = costs.layers[0], costs.layers[-1]
    model = pulp.LpProblem("stage_counts", pulp.LpMinimize)
    n = [
        model.add_variable(f"n_{s}", lowBound=1, upBound=count, cat=pulp.LpInteger)
        for s in range(p)
    ]
    t_max = model.add_variable("t_max", lowBound=0)
    model += pulp.lpSum(n) == count
    times, extras_memory = [], []
    for s in range(p):
        held = microbatches_in_flight(schedule, p, s, m)
        extra_time, extra_memory = p2p_s[s], 0.0
        for edge, part in ((s == 0, costs.pre), (s == p - 1, costs.post)):
            if edge:
                extra_time += part.time_s * scale
                extra_memory += part.states + held * part.activations * scale
        for edge, odd in ((s == 0, first), (s == p - 1, last)):
            if edge:  # the first/last layer's difference from the middle ones
                extra_time += (odd.time_s - layer.time_s) * scale
                extra_memory += (
                    odd.states - layer.states + held * scale * (odd.activations - layer.activations)
                )
        time = n[s] * layer.time_s * scale + extra_time
        model += t_max >= time
        if memory_limit is not None:
            model += (
                n[s] * (layer.states + held * layer.activations * scale) + extra_memory
                <= memory_limit
            )
        times.append(time)
        extras_memory.append(extra_memory)
    model += pulp.lpSum(times) + (m - 1) * t_max
    with quiet_stdout():
        model.solve(pulp.HiGHS(msg=False, timeLimit=time_limit))
    if model.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    counts = [round(v.value() or 0) for v in n]
    firsts = tuple(sum(counts[:s]) for s in range(p))
    states, acts, memory = [], [], []
    for s in range(p):
        held = microbatches_in_flight(schedule, p, s, m)
        mine = range(firsts[s], firsts[s] + counts[s])
        state = sum(costs.layers[i].states for i in mine)
        act = held * scale * sum(costs.layers[i].activations for i in mine)
        if s == 0:
            state += costs.pre.states
            act += held * scale * costs.pre.activations
        if s == p - 1:
            state += costs.post.states
            act += held * scale * costs.post.activations
        states.append(state)
        acts.append(act)
        memory.append(state + act)
    values = tuple(float(pulp.value(t)) for t in times)
    return StageCut(firsts, values, tuple(memory), tuple(states), tuple(acts))


def evaluate_cut(
    costs: LayerCosts,
    first_layers: Sequence[int],
    microbatches: int,
    schedule: str,
    scale: float,
    p2p_s: Sequence[float],
) -> StageCut:
    """What a given cut costs (stage ``s`` begins at layer ``first_layers[s]``): the same
    times and memory as the ILP's, for a cut fixed by the user (hints' ``pipeline.cuts``)."""
    count, p = len(costs.layers), len(first_layers)
    times, memory, states, acts = [], [], [], []
    for s in range(p):
        end = first_layers[s + 1] if s + 1 < p else count
        parts = [costs.layers[i] for i in range(first_layers[s], end)]
        if s == 0:
            parts.append(costs.pre)
        if s == p - 1:
            parts.append(costs.post)
        held = microbatches_in_flight(schedule, p, s, microbatches)
        state = sum(part.states for part in parts)
        act = held * scale * sum(part.activations for part in parts)
        times.append(sum(part.time_s for part in parts) * scale + p2p_s[s])
        states.append(state)
        acts.append(act)
        memory.append(state + act)
    return StageCut(tuple(first_layers), tuple(times), tuple(memory), tuple(states), tuple(acts))
