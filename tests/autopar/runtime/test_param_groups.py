"""FSDP's gathers grouped per layer (``runtime.param_groups``), on 2 gloo ranks.

One all-gather per layer (and per run of parameters outside the layers) forward, one
reduce-scatter per group backward, one regather per group that saved a weight, as FSDP2
does per block; values as the single gathers give them, training as on one device.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.runtime.collectives import all_gather, reduce_scatter
from autopar.runtime.comm import AxisGroup, CommLog
from autopar.runtime.param_groups import GatherParams, gather_group, reduce_scatter_group
from autopar.testing.ranks import run_ranks
from autopar_examples.models import build
from tests.autopar.runtime.collective_counts import counting

pytestmark = pytest.mark.multirank

N_LAYER = 3


def _train_step(rank: int, world: int) -> dict[str, Any]:
    """A tiny Llama under FSDP: collectives per phase, gradients next to one device's."""
    torch.manual_seed(0)
    model, (tokens,) = build("llama-tiny", batch_size=4, n_layer=N_LAYER)
    reference = copy.deepcopy(model)
    mesh = autopar.Mesh((world,), ("dp",), device="cpu")
    compiled = autopar.compile(
        model, mesh, example_inputs=(tokens,), force="fsdp", inputs="local", outputs="sharded"
    )
    local = tokens[compiled.input_slices()[0]]
    count = F.cross_entropy(reference(tokens).flatten(0, 1), tokens.flatten(), reduction="sum")
    (count / tokens.numel()).backward()
    forward: Counter[str] = Counter()
    backward: Counter[str] = Counter()
    with counting(forward):
        logits = compiled(local)
    loss = F.cross_entropy(logits.flatten(0, 1), local.flatten(), reduction="sum") / tokens.numel()
    with counting(backward):
        loss.backward()
    groups = [m for m in compiled.program.modules() if isinstance(m, GatherParams)]
    return {
        "prefetch": [dict(m.calls) for m in groups],  # in the program's order
        "regather_prefetch": _regather_prefetch(compiled.program),
        "forward": dict(forward),
        "backward": dict(backward),
        "group_sizes": sorted(len(m.dims) for m in groups),
        "code": compiled.code,
        "grads": {n: compiled.full_gradient(n) for n, _ in reference.named_parameters()},
        "ref_grads": {n: p.grad for n, p in reference.named_parameters()},
    }


def _regather_prefetch(program: torch.nn.Module) -> list[tuple[str, bool | None]]:
    """Backward's regathers in the order it made them: each one's group (the forward's
    ``GatherParams`` whose shards it gathers again) and whether it found its gather launched."""
    groups = {n: m for n, m in program.named_modules() if isinstance(m, GatherParams)}
    assert groups
    first = next(iter(groups.values()))
    assert first.sources is not None
    name_of = {}
    for name, module in groups.items():
        assert module.sources is not None
        name_of[module.sources()[0].data_ptr()] = name.removeprefix("all_gather_dp_params_")
    order = first.gathers.regathers.backward()
    return [(name_of[g._shards[0].data_ptr()], g.prefetched) for g in order]


def _tied_step(rank: int, world: int) -> dict[str, Any]:
    """A tiny GPT, whose head reads the embedding's weight (tied), under FSDP: the order
    backward regathers its groups in."""
    torch.manual_seed(0)
    model, (tokens,) = build("gpt-tiny", batch_size=4, n_layer=N_LAYER)
    mesh = autopar.Mesh((world,), ("dp",), device="cpu")
    compiled = autopar.compile(
        model, mesh, example_inputs=(tokens,), force="fsdp", inputs="local", outputs="sharded"
    )
    local = tokens[compiled.input_slices()[0]]
    logits = compiled(local)
    F.cross_entropy(logits.flatten(0, 1), local.flatten()).backward()
    return {"regather_prefetch": _regather_prefetch(compiled.program)}


def _groups_against_single_gathers(rank: int, world: int) -> dict[str, Any]:
    """``gather_group`` and ``reduce_scatter_group`` against one collective per tensor."""
    group = AxisGroup(dist.group.WORLD, ("dp",), CommLog())
    generator = torch.Generator().manual_seed(rank)
    shards = [torch.randn(s, generator=generator) for s in ((3, 4), (5, 2), (2, 3, 2), (7,))]
    dims = (0, 1, 2, 0)
    wholes = gather_group(shards, dims, group)
    singles = [all_gather(s, d, group) for s, d in zip(shards, dims, strict=True)]
    grads: list[torch.Tensor | None] = [torch.randn_like(w) for w in wholes]
    grads[2] = grads[2].transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
    grads[3] = None  # an unused weight's gradient
    shapes = [tuple(s.shape) for s in shards]
    pieces = reduce_scatter_group(grads, shapes, dims, group, shards[0])
    expected = [
        reduce_scatter(g, d, group) if g is not None else torch.zeros(s)
        for g, d, s in zip(grads, dims, shapes, strict=True)
    ]
    return {"wholes": (wholes, singles), "pieces": (pieces, expected)}


@pytest.fixture(scope="module")
def step() -> list[dict[str, Any]]:
    return run_ranks(_train_step, 2)


def test_one_gather_per_layer_and_direction(step: list[dict[str, Any]]) -> None:
    # groups: the embedding (before the layers), each layer (two norms and seven
    # projections), the final norm with the head (after the layers)
    for rank in step:
        assert rank["group_sizes"] == [1, 2] + [9] * N_LAYER
        assert "all_gather_dp_params_layer0" in rank["code"]
        # forward: one all-gather per group, nothing else (the loss is local)
        assert rank["forward"] == {"all_gather": N_LAYER + 2}
        # backward: one reduce-scatter per group (gloo: an all-reduce of the rows), one
        # regather per group whose weights were saved (not the embedding: its backward
        # needs only the token ids)
        assert rank["backward"] == {"all_reduce": N_LAYER + 2, "all_gather": N_LAYER + 1}


def test_each_group_is_gathered_while_the_one_before_it_computes(
    step: list[dict[str, Any]],
) -> None:
    """FSDP2's prefetch: forward launches each group's gather when the group before it is
    gathered, so only the first (the embedding's) is waited for; backward launches the
    gather of the group it reaches next when it gathers one again, so only the first
    regather (the head's) is waited for, and the embedding, which keeps no weight, is
    never gathered again."""
    for rank in step:
        assert rank["prefetch"] == [{"waited": 1}] + [{"prefetched": 1}] * (N_LAYER + 1)
        layers = [(f"layer{i}", True) for i in reversed(range(N_LAYER))]
        assert rank["regather_prefetch"] == [("outside3", False), *layers]


def test_backward_reaches_a_tied_embedding_first() -> None:
    """FSDP2's backward order is the reverse of the order the groups' weights were last
    saved in forward: the head saves the embedding's weight (tied), so the embedding's group
    is regathered first, where the head's backward needs it, and launches the final norm's
    group; one regather a backward waits (the one the ledger files whole,
    ``autopar_passes.ledger.reshard_entries``)."""
    for rank in run_ranks(_tied_step, 2):
        layers = [(f"layer{i}", True) for i in reversed(range(N_LAYER))]
        assert rank["regather_prefetch"] == [("outside0", False), ("outside3", True), *layers]


def test_grouped_fsdp_gradients_equal_one_device(step: list[dict[str, Any]]) -> None:
    for rank in step:
        for name, ref in rank["ref_grads"].items():
            scale = float(ref.abs().max()) or 1.0
            torch.testing.assert_close(
                rank["grads"][name], ref, rtol=1e-4, atol=1e-6 * scale, msg=name
            )


def test_group_collectives_equal_one_collective_per_tensor() -> None:
    for rank in run_ranks(_groups_against_single_gathers, 2):
        for kind in ("wholes", "pieces"):
            got, want = rank[kind]
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
