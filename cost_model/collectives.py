"""Collective communication time on a device mesh: the alpha-beta model with nccl-tests factors.

One collective of ``S`` bytes over a group of ``n`` devices joined by links of bandwidth ``B``
(bytes/s per device per direction, times the preset's network efficiency) and per-step
latency ``alpha``, launched with a fixed overhead ``alpha_0``, takes

    t = alpha_0 + steps(n) * alpha + S * factor(n) / B

=================  ==============  ==========  ===========================================
collective         factor(n)       steps(n)    ``S`` is (nccl-tests' size)
=================  ==============  ==========  ===========================================
all_reduce         2(n-1)/n        2(n-1)      the array
reduce_scatter     (n-1)/n         n-1         the array before (each device keeps S/n)
all_gather         (n-1)/n         n-1         the array after (each device starts with S/n)
all_to_all         (n-1)/n         n-1         each device's buffer (it keeps 1/n of it)
broadcast          1               n-1         the array
p2p                1               1           the message
=================  ==============  ==========  ===========================================

Factors: nccl-tests ``doc/PERFORMANCE.md`` (bus bandwidth); steps: the ring algorithms (an
all-reduce is a reduce-scatter then an all-gather, ZeRO Sec. 7.1); the latency split into a
per-call ``alpha_0`` plus a per-hop ``alpha`` follows torch DTensor's cost model
(``torch/distributed/tensor/_collective_utils.py``: 6.6 us + hops x 0.6 us on NVLink) and
NCCL's own tuning model (a base latency per algorithm plus a hardware latency per step).

**One mesh axis** uses that axis's link: the inter-node one if the axis's devices span more
than one node (``MeshSpec.crosses_nodes``), else the intra-node one.

**Several axes at once.** Order the axes fastest link first and cut that order into
contiguous groups; each grouping is one way to run the collective:

- one group is the *flat ring* over all ``n`` devices, every byte charged at the slowest
  link involved (a ring that leaves a node is as slow as its slowest hop);
- more groups are the *hierarchical* forms (Horovod's hierarchical all-reduce, the 2-D torus
  all-reduce of Mikami et al. 2018 / Ying et al. 2018): an all-reduce reduce-scatters inside
  the fast groups first (``S``, ``S/n_1``, ...), all-reduces what is left (``S/n_inner``)
  across the slowest group, and all-gathers back; a reduce-scatter does the same first
  half, an all-gather the second half (slowest group first, on the small pieces); an
  all-to-all runs once per group (two-phase all-to-all), a broadcast once per group.

All groupings are costed (``2^(k-1)`` for ``k`` axes) and the cheapest is returned as a
``CollectiveCost`` with its ``form`` and ``steps``. With equal links the forms move the same
bytes; the flat ring makes one call, the hierarchical form fewer hops: which wins then
depends on ``alpha_0`` versus ``alpha`` (exact ties go to the flat ring). With a slow outer
link the hierarchical form sends only ``1/n_inner`` of the bytes over it, and wins.

What it leaves out: contention between collectives running at once, NCCL's tree and
NVLS algorithms and protocol switches (LL/LL128/Simple) for small messages, rail-optimised
topologies, uneven splits, and a ring that only partly crosses nodes (charged at the slow
link for all its bytes; a direct all-to-all sends only ``(n - n_inner)/n`` over it).

>>> cost = MeshCost(MeshSpec((2, 8), ("dp", "tp"), device="h100-sxm"))  # 2 nodes of 8
>>> cost.collective("all_reduce", 1 << 30, (0, 1)).form
'hierarchical'
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable
from typing import Literal, NamedTuple

from autopar_cost_model.hardware import (
    COLLECTIVE_KINDS,
    DevicePreset,
    Link,
    load_preset,
    read_curve,
)
from autopar_cost_model.reshard import Reshard, reshard_cost
from autopar_plans.errors import UsageError
from autopar_plans.mesh import MeshSpec
from autopar_plans.placement import Layout

Form = Literal["none", "ring", "hierarchical"]
COLLECTIVES: tuple[str, ...] = COLLECTIVE_KINDS


class AxisLink(NamedTuple):
    """One mesh axis as the collectives see it; bandwidths already times the efficiency."""

    axis: int
    size: int
    bandwidth: float
    latency: float
    # (kind, its (bytes, bandwidth) curve) of the collectives whose bandwidth is not
    # ``bandwidth`` at every size (``Link.bandwidth_by_kind``)
    by_kind: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()

    def bandwidth_of(self, kind: str, nbytes: float) -> float:
        for name, curve in self.by_kind:
            if name == kind:
                return read_curve(curve, nbytes)
        return self.bandwidth


class CollectiveStep(NamedTuple):
    """One call of a collective on a group of mesh axes: its time, and the bytes each device
    sends (``nbytes x bus_factor``), for ``Estimate.comm_bytes_per_step``."""

    kind: str
    axes: tuple[int, ...]
    nbytes: float
    time: float
    sent: float


class CollectiveCost(NamedTuple):
    """The cheapest way found to run a collective: its time, its form and the calls it makes."""

    time: float
    form: Form
    steps: tuple[CollectiveStep, ...]

    @property
    def sent(self) -> float:
        """Bytes each device sends, over all the steps."""
        return sum(step.sent for step in self.steps)


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes each device sends per byte of ``S``."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind in ("broadcast", "p2p"):
        return 1.0
    raise UsageError(f"unknown collective {kind!r}; one of {', '.join(COLLECTIVES)}")


def ring_steps(kind: str, n: int) -> int:
    """Latency steps (hops) of the ring/chain algorithm for ``kind`` on ``n`` devices."""
    if n <= 1:
        return 0
    if kind == "p2p":
        return 1
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def ring_time(
    kind: str, nbytes: float, n: int, bandwidth: float, latency: float, *, launch: float = 0.0
) -> float:
    """``launch + ring_steps * latency + nbytes * bus_factor / bandwidth``; 0 for ``n <= 1``."""
    if n <= 1:
        return 0.0
    return launch + ring_steps(kind, n) * latency + nbytes * bus_factor(kind, n) / bandwidth


def _flat(kind: str, nbytes: float, group: tuple[AxisLink, ...], launch: float) -> CollectiveStep:
    """The collective as one ring over the group's devices, at its slowest link."""
    n = math.prod(link.size for link in group)
    bandwidth = min(link.bandwidth_of(kind, nbytes) for link in group)
    latency = max(link.latency for link in group)
    axes = tuple(sorted(link.axis for link in group))
    time = ring_time(kind, nbytes, n, bandwidth, latency, launch=launch)
    return CollectiveStep(kind, axes, nbytes, time, nbytes * bus_factor(kind, n))


def _groupings(links: tuple[AxisLink, ...]) -> Iterable[tuple[tuple[AxisLink, ...], ...]]:
    """Every cut of ``links`` (fastest first) into contiguous groups; the flat one first."""
    k = len(links)
    for cuts in itertools.product((False, True), repeat=k - 1):
        groups, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(links[start:i])
                start = i
        groups.append(links[start:])
        yield tuple(groups)


def _composed(
    kind: str, nbytes: float, groups: tuple[tuple[AxisLink, ...], ...], launch: float
) -> tuple[CollectiveStep, ...]:
    """The calls of the hierarchical form over ``groups`` (fastest group first)."""
    sizes = [math.prod(link.size for link in g) for g in groups]
    # Bytes each call sees: the i-th reduce-scatter works on S / (n_1 ... n_{i-1}).
    shrunk = [nbytes / math.prod(sizes[:i]) for i in range(len(groups))]
    if kind == "reduce_scatter":
        return tuple(_flat(kind, shrunk[i], g, launch) for i, g in enumerate(groups))
    if kind == "all_gather":
        pairs = reversed(list(enumerate(groups)))  # slowest group first, on the small pieces
        return tuple(_flat(kind, shrunk[i], g, launch) for i, g in pairs)
    if kind == "all_reduce":
        down = [_flat("reduce_scatter", shrunk[i], g, launch) for i, g in enumerate(groups[:-1])]
        middle = _flat("all_reduce", shrunk[-1], groups[-1], launch)
        up = [_flat("all_gather", s.nbytes, groups[i], launch) for i, s in enumerate(down)]
        return (*down, middle, *reversed(up))
    return tuple(_flat(kind, nbytes, g, launch) for g in groups)  # all_to_all, broadcast


@functools.lru_cache(maxsize=1 << 16)
def collective_cost(
    kind: str, nbytes: float, links: tuple[AxisLink, ...], launch: float
) -> CollectiveCost:
    """The cheapest form of ``kind`` on ``nbytes`` over the mesh axes ``links`` (cached).

    A pure function of its arguments; ``MeshCost`` is the convenient way to call it.
    """
    bus_factor(kind, 2)  # rejects an unknown kind
    active = tuple(
        sorted(
            (lk for lk in links if lk.size > 1),
            key=lambda lk: (-lk.bandwidth, lk.latency, -lk.axis),
        )
    )
    if not active or nbytes <= 0:
        return CollectiveCost(0.0, "none", ())
    if kind == "p2p" and len(active) > 1:
        raise UsageError("a point-to-point transfer runs along one mesh axis")
    best: CollectiveCost | None = None
    for groups in _groupings(active):
        if len(groups) == 1:
            steps: tuple[CollectiveStep, ...] = (_flat(kind, nbytes, groups[0], launch),)
        else:
            steps = _composed(kind, nbytes, groups, launch)
        time = sum(step.time for step in steps)
        if best is None or time < best.time:
            best = CollectiveCost(time, "ring" if len(groups) == 1 else "hierarchical", steps)
    assert best is not None
    return best


class MeshCost:
    """Collective and resharding times on one mesh of one kind of device.

    >>> cost = MeshCost(MeshSpec((8,), ("dp",)), load_preset("h100-sxm"))
    >>> round(cost.all_reduce(1e9, 0) * 1e3, 3)   # 2*7/8 * 1e9 / (0.8 * 450e9) + 6.6 + 14 * 0.6 us
    4.876

    Every method is cached by its arguments, so the ILP builder may call them freely.
    MeshCosts of equal meshes and presets compare (and hash) equal and share the caches.
    """

    def __init__(self, mesh: MeshSpec, preset: DevicePreset | None = None) -> None:
        self.mesh = mesh
        self.preset = load_preset(mesh.device) if preset is None else preset
        self.gpus_per_node = mesh.gpus_per_node or self.preset.gpus_per_node
        efficiency = self.preset.efficiency.network
        self.links = tuple(
            AxisLink(
                axis,
                size,
                link.bandwidth * efficiency,
                link.latency,
                tuple(
                    (
                        kind,
                        tuple((size, bw * efficiency) for size, bw in link.bandwidth_curve(kind)),
                    )
                    for kind in sorted(link.bandwidth_by_kind)
                ),
            )
            for axis, size in enumerate(mesh.shape)
            for link in (self.axis_link(axis),)
        )
        self.launch_overhead = self.preset.launch_overhead
        self._key = (self.links, self.launch_overhead)
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshCost) and self._key == other._key

    def __repr__(self) -> str:
        return f"MeshCost({self.mesh.describe()}, preset={self.preset.name!r})"

    def crosses_nodes(self, axis: int) -> bool:
        return self.mesh.crosses_nodes(axis, self.gpus_per_node)

    def axis_link(self, axis: int) -> Link:
        """The link mesh axis ``axis`` talks over (peak figures, before efficiency)."""
        return self.preset.link(self.crosses_nodes(axis))

    def collective(self, kind: str, nbytes: float, axes: int | Iterable[int]) -> CollectiveCost:
        """The cheapest form of collective ``kind`` over mesh ``axes``; see the module docs."""
        links = self.links
        if isinstance(axes, int):
            picked: tuple[AxisLink, ...] = (links[self._check(axes)],)
        else:
            picked = tuple(links[self._check(a)] for a in sorted(set(axes)))
        return collective_cost(kind, float(nbytes), picked, self.launch_overhead)

    def _check(self, axis: int) -> int:
        if not 0 <= axis < len(self.links):
            raise UsageError(f"mesh axis {axis} does not exist; the mesh has {len(self.links)}")
        return axis

    def all_reduce(self, nbytes: float, axes: int | Iterable[int]) -> float:
        """Seconds to all-reduce an array of ``nbytes`` over ``axes``."""
        return self.collective("all_reduce", nbytes, axes).time

    def all_gather(self, nbytes: float, axes: int | Iterable[int]) -> float:
        """Seconds to all-gather into an array of ``nbytes`` (each device holds a 1/n piece)."""
        return self.collective("all_gather", nbytes, axes).time

    def reduce_scatter(self, nbytes: float, axes: int | Iterable[int]) -> float:
        """Seconds to reduce-scatter an array of ``nbytes`` (each device keeps a 1/n piece)."""
        return self.collective("reduce_scatter", nbytes, axes).time

    def all_to_all(self, nbytes: float, axes: int | Iterable[int]) -> float:
        """Seconds for an all-to-all where each device's buffer is ``nbytes`` (nccl-tests).

        Re-splitting a tensor of ``S`` bytes (as it stands on the axis) from one dim to
        another is an all-to-all of ``S / n`` bytes: each device holds ``S / n``.
        """
        return self.collective("all_to_all", nbytes, axes).time

    def broadcast(self, nbytes: float, axes: int | Iterable[int]) -> float:
        """Seconds to broadcast ``nbytes`` from one device to the others on ``axes``."""
        return self.collective("broadcast", nbytes, axes).time

    def p2p(self, nbytes: float, axis: int) -> float:
        """Seconds to send ``nbytes`` to a neighbour along ``axis`` (a pipeline hand-off)."""
        return self.collective("p2p", nbytes, axis).time

    def reshard(self, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> Reshard:
        """The collectives that turn layout ``src`` into ``dst``; see
        ``autopar_cost_model.reshard``."""
        return reshard_cost(self, src, dst, tuple(shape), itemsize)
