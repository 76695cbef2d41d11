"""Collective times: nccl-tests' bus-bandwidth factors, latency terms, flat vs hierarchical.

Source of the factors: nccl-tests doc/PERFORMANCE.md, as quoted in shared/REFERENCE.md:
t = S * factor / B with all-reduce 2(n-1)/n, reduce-scatter, all-gather and all-to-all
(n-1)/n, broadcast 1.
"""

from __future__ import annotations

import pytest

from autopar_cost_model import MeshCost, collective_cost, load_preset, tp_traffic_per_layer
from autopar_plans import MeshSpec

S = 3 * 2**30  # bytes: large, and not a multiple of every n so rounding would show
B = 100e9  # intra-node bytes/s of the synthetic preset

FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind", sorted(FACTORS))
def test_zero_latency_time_is_bytes_times_bus_factor_over_bandwidth(make_preset, kind, n):
    cost = MeshCost(MeshSpec((n,), ("x",)), make_preset(intra_bw=B))
    method = getattr(cost, kind)
    assert method(S, 0) == pytest.approx(S * FACTORS[kind](n) / B, rel=1e-12)
    assert method(S, (0,)) == method(S, 0)


def test_latency_is_launch_plus_one_alpha_per_ring_step(make_preset):
    # torch DTensor's model: 6.6 us + hops * 0.6 us (torch/distributed/tensor/_collective_utils.py)
    preset = make_preset(intra_bw=B, intra_lat=0.6e-6, launch=6.6e-6)
    cost = MeshCost(MeshSpec((8,), ("x",)), preset)
    assert cost.all_reduce(0, 0) == 0.0  # nothing to send: no call
    assert cost.all_reduce(8, 0) == pytest.approx(6.6e-6 + 14 * 0.6e-6 + 8 * 2 * 7 / 8 / B)
    assert cost.all_gather(8, 0) == pytest.approx(6.6e-6 + 7 * 0.6e-6 + 8 * 7 / 8 / B)
    assert cost.p2p(1e6, 0) == pytest.approx(6.6e-6 + 0.6e-6 + 1e6 / B)


def test_a_size_one_axis_costs_nothing(make_preset):
    cost = MeshCost(MeshSpec((1, 4), ("x", "y")), make_preset())
    assert cost.all_reduce(S, 0) == 0.0
    assert cost.all_reduce(S, (0, 1)) == cost.all_reduce(S, 1)


def test_axis_links_follow_node_boundaries():
    preset = load_preset("h100-sxm")  # 8 per node; NVLink 450 GB/s, NDR 50 GB/s per direction
    cost = MeshCost(MeshSpec((4, 8), ("dp", "tp")), preset)
    assert cost.axis_link(1) == preset.intra_node
    assert cost.axis_link(0) == preset.inter_node
    small_nodes = MeshCost(MeshSpec((4, 8), ("dp", "tp"), gpus_per_node=4), preset)
    assert small_nodes.axis_link(1) == preset.inter_node  # mesh.gpus_per_node wins


def test_network_efficiency_scales_bandwidth(make_preset):
    preset = make_preset(intra_bw=B).model_copy(
        update={"efficiency": make_preset().efficiency.model_copy(update={"network": 0.5})}
    )
    cost = MeshCost(MeshSpec((4,), ("x",)), preset)
    assert cost.all_gather(S, 0) == pytest.approx(S * 3 / 4 / (0.5 * B))


def test_two_axis_all_reduce_goes_hierarchical_when_the_outer_axis_crosses_nodes(make_preset):
    # 2 nodes x 8 GPUs, NVLink 100 GB/s vs 10 GB/s between nodes: the flat ring would send
    # 2(n-1)/n S at 10 GB/s; the hierarchical form sends only S/8 across nodes.
    preset = make_preset(intra_bw=100e9, inter_bw=10e9, intra_lat=1e-6, inter_lat=5e-6, launch=5e-6)
    cost = MeshCost(MeshSpec((2, 8), ("node", "gpu")), preset)
    assert cost.crosses_nodes(0) and not cost.crosses_nodes(1)
    result = cost.collective("all_reduce", S, (0, 1))
    assert result.form == "hierarchical"
    kinds = [(step.kind, step.axes, step.nbytes) for step in result.steps]
    assert kinds == [
        ("reduce_scatter", (1,), S),
        ("all_reduce", (0,), S / 8),
        ("all_gather", (1,), S),
    ]
    flat = 2 * 15 / 16 * S / 10e9
    hierarchical = 2 * 7 / 8 * S / 100e9 + 2 * 1 / 2 * (S / 8) / 10e9
    latency = 3 * 5e-6 + (7 + 7) * 1e-6 + 2 * 5e-6  # 3 calls; RS and AG 7 hops, AR 2 hops
    bandwidth_part = result.time - latency
    assert bandwidth_part == pytest.approx(hierarchical)
    assert result.time < flat


def test_two_axis_all_reduce_stays_a_flat_ring_when_links_are_equal(make_preset):
    # Same links on both axes: both forms move 2(n-1)/n S; the ring makes one call instead
    # of three, which wins with DTensor's latencies (6.6 us per call, 0.6 us per hop).
    preset = make_preset(
        intra_bw=100e9, inter_bw=100e9, intra_lat=0.6e-6, inter_lat=0.6e-6, launch=6.6e-6
    )
    cost = MeshCost(MeshSpec((2, 4), ("x", "y")), preset)
    result = cost.collective("all_reduce", S, (0, 1))
    assert result.form == "ring"
    assert result.steps[0].axes == (0, 1)
    assert result.time == pytest.approx(6.6e-6 + 14 * 0.6e-6 + 2 * 7 / 8 * S / 100e9)
    # without any latency the two tie exactly, and the tie goes to the flat ring
    no_latency = MeshCost(MeshSpec((2, 4), ("x", "y")), make_preset(intra_bw=B, inter_bw=B))
    assert no_latency.collective("all_reduce", S, (0, 1)).form == "ring"


def test_hierarchical_all_gather_crosses_nodes_on_the_small_pieces(make_preset):
    cost = MeshCost(MeshSpec((2, 8), ("node", "gpu")), make_preset(intra_bw=100e9, inter_bw=10e9))
    gather = cost.collective("all_gather", S, (0, 1))
    assert [(s.kind, s.axes, s.nbytes) for s in gather.steps] == [
        ("all_gather", (0,), S / 8),
        ("all_gather", (1,), S),
    ]
    scatter = cost.collective("reduce_scatter", S, (0, 1))
    assert [(s.kind, s.axes, s.nbytes) for s in scatter.steps] == [
        ("reduce_scatter", (1,), S),
        ("reduce_scatter", (0,), S / 8),
    ]
    assert gather.time == pytest.approx(S / 8 / 2 / 10e9 + S * 7 / 8 / 100e9)


def test_three_axes_consider_every_grouping(make_preset):
    # axes 1 and 2 inside a node (equal links), axis 0 across nodes
    preset = make_preset(
        intra_bw=100e9, inter_bw=10e9, intra_lat=0.6e-6, inter_lat=3e-6, launch=6.6e-6
    )
    cost = MeshCost(MeshSpec((4, 2, 4), ("a", "b", "c")), preset)
    result = cost.collective("all_reduce", S, (0, 1, 2))
    assert result.form == "hierarchical"
    # the cheapest keeps the two NVLink axes together as one ring of 8
    assert result.steps[0].axes == (1, 2) and result.steps[1].axes == (0,)


def test_results_are_cached_by_argument():
    cost = MeshCost(MeshSpec((8,), ("dp",)), load_preset("a100-80gb-sxm"))
    again = MeshCost(MeshSpec((8,), ("dp",)), load_preset("a100-80gb-sxm"))
    assert cost == again and hash(cost) == hash(again)
    cost.all_reduce(12345678, 0)
    hits = collective_cost.cache_info().hits
    again.all_reduce(12345678, 0)
    assert collective_cost.cache_info().hits == hits + 1


def test_megatron_tensor_parallel_traffic_equals_four_all_reduces(make_preset):
    # Narayanan et al. 2021, Sec. 3.2: 8 b s h (t-1)/t values per layer per device
    b, s, h, t = 4, 2048, 4096, 8
    per_all_reduce = 2 * (t - 1) / t * b * s * h  # values one device sends (ring all-reduce)
    assert tp_traffic_per_layer(b, s, h, t) == pytest.approx(4 * per_all_reduce)
    cost = MeshCost(MeshSpec((t,), ("tp",)), make_preset(intra_bw=B))
    seconds = 4 * cost.all_reduce(b * s * h * 2, 0)  # bf16 activations
    assert seconds == pytest.approx(tp_traffic_per_layer(b, s, h, t, bytes_per_value=2) / B)


def test_unknown_collective_and_axis_are_refused(make_preset):
    from autopar_plans.errors import UsageError

    cost = MeshCost(MeshSpec((2, 2), ("x", "y")), make_preset())
    with pytest.raises(UsageError, match="unknown collective"):
        cost.collective("gossip", 10, 0)
    with pytest.raises(UsageError, match="axis 2"):
        cost.all_reduce(10, 2)
    with pytest.raises(UsageError, match="one mesh axis"):
        cost.collective("p2p", 10, (0, 1))


def test_bytes_sent_per_device_follow_the_bus_factor(make_preset):
    # what Estimate.comm_bytes_per_step adds up: ZeRO Sec. 7: an all-reduce of Psi sends 2 Psi
    cost = MeshCost(MeshSpec((2, 8), ("node", "gpu")), make_preset(intra_bw=100e9, inter_bw=10e9))
    assert cost.collective("all_reduce", S, 1).sent == pytest.approx(2 * 7 / 8 * S)
    hierarchical = cost.collective("all_reduce", S, (0, 1))
    assert hierarchical.sent == pytest.approx(2 * 7 / 8 * S + 2 * 1 / 2 * S / 8)


def test_a_collective_reads_its_own_bandwidth_by_kind_and_message_size(make_preset):
    """``Link.bandwidth_by_kind``: gloo's all-gather at half the link's bandwidth; an
    all-reduce's bandwidth growing with the message, read between the measured sizes on a
    log scale (1 GB/s at 1 MiB, 4 GB/s at 64 MiB: 2.5 GB/s at 8 MiB)."""
    from autopar_cost_model import Link

    link = Link(
        bandwidth=10e9,
        latency=0.0,
        bandwidth_by_kind={"all_gather": 5e9, "all_reduce": [(2**20, 1e9), (2**26, 4e9)]},
    )
    preset = make_preset().model_copy(update={"intra_node": link})
    cost = MeshCost(MeshSpec((4,), ("dp",)), preset)
    assert cost.all_gather(1e6, 0) == pytest.approx(1e6 * 3 / 4 / 5e9)
    assert cost.reduce_scatter(1e6, 0) == pytest.approx(1e6 * 3 / 4 / 10e9)
    eight = 8 * 2**20
    assert cost.all_reduce(eight, 0) == pytest.approx(eight * 1.5 / 2.5e9)
    assert cost.all_reduce(1024, 0) == pytest.approx(1024 * 1.5 / 1e9)  # below: the first


def test_bandwidths_by_kind_must_name_collectives_and_grow_in_size():
    from pydantic import ValidationError

    from autopar_cost_model import Link

    with pytest.raises(ValidationError, match="unknown collectives"):
        Link(bandwidth=1e9, latency=0.0, bandwidth_by_kind={"allgather": 1e9})
    with pytest.raises(ValidationError, match="sizes must grow"):
        Link(bandwidth=1e9, latency=0.0, bandwidth_by_kind={"all_reduce": [(2.0, 1e9), (1.0, 1e9)]})
