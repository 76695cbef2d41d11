"""The stage cut: contiguous layers onto pipeline stages.

Given per-layer costs for one microbatch (``t_l``: forward + backward seconds; ``a_l``:
saved activation bytes; ``w_l``: parameter state bytes) and those of the parts before and
after the layers, choose ``x[i, s]`` (layer ``i`` runs on stage ``s``)::

    min  sum_s T_s + (m - 1) T_max                 (GPipe and 1F1B; DESIGN.md)
    s.t. sum_s x[i, s] = 1                          every layer on one stage
         sum_s s x[i, s] <= sum_s s x[i+1, s] <= sum_s s x[i, s] + 1
                                                    contiguous, in order, no stage skipped
         x[0, 0] = 1,  x[L-1, p-1] = 1              first and last stage hold a layer each
         T_s = sum_l x[i, s] t_l + [s = 0] t_pre + [s = p-1] t_post + c_s
               - (what FSDP's prefetch hides between neighbours on stage s)
         T_max >= T_s
         sum_l x[i, s] (w_l + f_s a_l) + [s = 0] (w_pre + f_0 a_pre)
             + [s = p-1] (w_post + f_{p-1} a_post) <= M          memory of stage s

``f_s`` is the number of microbatches stage ``s`` holds in flight under the schedule
(``autopar_cost_model.memory.microbatches_in_flight``: m for GPipe, min(p - s, m) for 1F1B), ``c_s``
the point-to-point time of the activations stage ``s`` sends and receives, ``M`` the memory
per device. A stage's parts run as a chain (``layer_costs.chain_time``): each layer's
gathers hide behind the layer before it on the same stage, and its regathers behind the
one after; the stage's first gathers and last regathers wait whole. Solved exactly by
dynamic programming (``cut_stages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from autopar_cost_model.memory import microbatches_in_flight
from autopar_cost_model.offload import FETCHES_IN_FLIGHT
from autopar_passes.pipeline.layer_costs import (
    LayerCosts,
    Part,
    chain_time,
    held_activations,
    prefetch_hidden,
)


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
) -> StageCut | None:
    """The best contiguous cut, or None when no cut fits the memory limit.

    ``scale`` multiplies the per-microbatch quantities (time, activations) traced for another
    microbatch size; ``p2p_s[s]`` is stage ``s``'s point-to-point time per microbatch.

    In the objective above, ``sum_s T_s`` is every layer's time plus the parts' and the
    point-to-point times, less what the prefetch hides across the ``p - 1`` boundaries,
    so the best cut is the one with the least ``T_max`` among those that fit, up to that
    hiding (at most a layer's gathers a boundary: ``evaluate_cut`` prices the cut
    chosen as it runs): a min-max partition of a sequence, which dynamic programming
    solves exactly in ``O(p L^2)`` steps (Alpa's stage DP has this shape, Zheng et al.
    2022). As an ILP, with the memory rows binding, HiGHS took up to its time limit per
    (microbatch size, schedule) on llama3-70b over 64 stages.
    """
    count, p = len(costs.layers), stages
    if p > count:
        return None
    held = [microbatches_in_flight(schedule, p, s, microbatches) for s in range(p)]
    time_sum = _prefix([layer.time_at(scale) for layer in costs.layers])
    # hidden[k]: what the prefetch hides between the first k + 1 parts of the chain
    # (before the layers, each layer, after), each pair once: a stage's parts are a run of
    # the chain, and hide what lies between their first and last
    chain: list[Part] = [costs.pre, *costs.layers, costs.post]
    hidden = _prefix([prefetch_hidden(a, b, scale) for a, b in pairwise(chain)])
    state_sum = _prefix([layer.states for layer in costs.layers])
    act_sum = _prefix([layer.activations for layer in costs.layers])
    cast_sum = _prefix([layer.casts for layer in costs.layers])
    call_cast_sum = _prefix([layer.call_casts for layer in costs.layers])

    def stage(s: int, first: int, end: int, working: float) -> tuple[float, float]:
        """Time and memory of stage ``s`` holding layers ``first .. end - 1``, of which the
        largest fetches ``working`` bytes (offloaded parameters)."""
        time = time_sum[end] - time_sum[first] + p2p_s[s]
        # the chain's indices: layer i is part i + 1
        start, stop = (0 if s == 0 else first + 1), (count + 1 if s == p - 1 else end)
        time -= hidden[stop] - hidden[start]
        states = state_sum[end] - state_sum[first]
        acts = act_sum[end] - act_sum[first]
        casts = cast_sum[end] - cast_sum[first]
        call_casts = call_cast_sum[end] - call_cast_sum[first]
        for edge, part in ((s == 0, costs.pre), (s == p - 1, costs.post)):
            if edge:
                time += part.time_at(scale)
                states += part.states
                acts += part.activations
                casts += part.casts
                call_casts += part.call_casts
                working = max(working, part.working)
        # as ``held_activations``, with offloaded parameters' copies in flight (the part in
        # use and the one prefetched) from the running largest
        held_bytes = held[s] * (scale * acts + call_casts) + casts + FETCHES_IN_FLIGHT * working
        return time, states + held_bytes

    # slowest[s][i]: the least T_max of stages s .. p-1 holding layers i .. L-1 (inf: none
    # fits); after[s][i]: where stage s's layers end in that cut
    inf = float("inf")
    slowest = [[inf] * (count + 1) for _ in range(p + 1)]
    after = [[0] * (count + 1) for _ in range(p + 1)]
    slowest[p][count] = 0.0
    for s in reversed(range(p)):
        later = p - 1 - s  # stages after s, a layer each at least
        for first in range(s, count - later):
            working = 0.0  # the largest layer's fetched bytes so far (a running max)
            for end in range(first + 1, count - later + 1):
                working = max(working, costs.layers[end - 1].working)
                rest = slowest[s + 1][end]
                if rest == inf:
                    continue
                time, memory = stage(s, first, end, working)
                if memory_limit is not None and memory > memory_limit:
                    continue
                value = max(time, rest)
                if value < slowest[s][first]:
                    slowest[s][first], after[s][first] = value, end
    if slowest[0][0] == inf:
        return None
    firsts, first = [], 0
    for s in range(p):
        firsts.append(first)
        first = after[s][first]
    return evaluate_cut(costs, firsts, microbatches, schedule, scale, p2p_s)


def _prefix(values: Sequence[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


def evaluate_cut(
    costs: LayerCosts,
    first_layers: Sequence[int],
    microbatches: int,
    schedule: str,
    scale: float,
    p2p_s: Sequence[float],
) -> StageCut:
    """What a given cut costs (stage ``s`` begins at layer ``first_layers[s]``): the
    search's own cut, or one fixed by the user (hints' ``pipeline.cuts``)."""
    count, p = len(costs.layers), len(first_layers)
    times, memory, states, acts = [], [], [], []
    for s in range(p):
        end = first_layers[s + 1] if s + 1 < p else count
        parts = [costs.layers[i] for i in range(first_layers[s], end)]
        parts = [costs.pre] * (s == 0) + parts + [costs.post] * (s == p - 1)
        held = microbatches_in_flight(schedule, p, s, microbatches)
        state = sum(part.states for part in parts)
        act = held_activations(parts, held, scale)
        times.append(chain_time(parts, scale) + p2p_s[s])
        states.append(state)
        acts.append(act)
        memory.append(state + act)
    return StageCut(tuple(first_layers), tuple(times), tuple(memory), tuple(states), tuple(acts))
