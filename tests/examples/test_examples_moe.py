"""MoE routing: capacity, dropped tokens, top-1 and top-2, groups, against a token-by-token
loop; Mixtral's sparse block against Hugging Face's own loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar_examples.models import build
from autopar_examples.models.moe import MoE, expert_capacity, route
from autopar_examples.models.moe_sparse import SparseMoE
from autopar_plans.errors import UsageError

E, D = 4, 32  # moe-tiny: 4 experts, d_model 32


def moe_layer(top_k: int, capacity_factor: float) -> MoE:
    torch.manual_seed(0)
    model, _ = build("moe-tiny", top_k=top_k, capacity_factor=capacity_factor)
    return model.layers[0].moe


def loop_reference(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: choice i of every token (in order) before choice i + 1; a choice
    whose expert is full is dropped. Returns the output and a (B, T) mask of tokens that
    got no slot at all."""
    B, T, _ = x.shape
    probs = F.softmax(layer.router(x).float(), dim=-1)
    gates, experts = probs.topk(layer.top_k, dim=-1)
    if layer.top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    capacity = expert_capacity(T, layer.n_experts, layer.top_k, layer.capacity_factor)
    w = layer.experts
    y = torch.zeros_like(x)
    placed = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        used = [0] * layer.n_experts
        for i in range(layer.top_k):
            for t in range(T):
                e = int(experts[b, t, i])
                if used[e] == capacity:
                    continue
                used[e] += 1
                placed[b, t] = True
                h = F.silu(x[b, t] @ w.w_gate[e]) * (x[b, t] @ w.w_up[e])
                y[b, t] += gates[b, t, i] * (h @ w.w_down[e])
    return y, ~placed


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [0.25, 1.0, 2.0])
def test_moe_matches_token_by_token_loop(top_k: int, capacity_factor: float) -> None:
    layer = moe_layer(top_k, capacity_factor)
    x = torch.randn(2, 16, D)
    y, aux_loss = layer(x)
    expected, _ = loop_reference(layer, x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    assert aux_loss.shape == () and torch.isfinite(aux_loss)


@pytest.mark.parametrize("top_k", [1, 2])
def test_dropped_tokens_get_zero_moe_output(top_k: int) -> None:
    layer = moe_layer(top_k, capacity_factor=0.25)  # C = 1 (top-1) or 2 (top-2) slots
    x = torch.randn(2, 16, D)
    with torch.no_grad():
        y, _ = layer(x)
        routing, _ = layer.route_tokens(x)
    dropped = routing.dispatch.sum(dim=(2, 3)) == 0  # (B, T): no slot in any expert
    _, reference_dropped = loop_reference(layer, x)
    assert torch.equal(dropped, reference_dropped)
    # 4 experts x C slots per sequence of 16 tokens: at least 16 - 4C tokens are dropped.
    assert dropped.sum(dim=1).min() >= 16 - 4 * (1 if top_k == 1 else 2)
    assert torch.equal(y[dropped], torch.zeros_like(y[dropped]))
    assert (y[~dropped].abs().sum(dim=-1) > 0).all()


def test_dropped_tokens_pass_through_the_residual() -> None:
    torch.manual_seed(0)
    model, _ = build("moe-tiny", top_k=1, capacity_factor=0.25)
    block = model.layers[0]
    x = torch.randn(2, 16, D)
    with torch.no_grad():
        h = x + block.attn(block.attn_norm(x))
        routing, _ = block.moe.route_tokens(block.mlp_norm(h))
        out, _ = block(x)
    dropped = routing.dispatch.sum(dim=(2, 3)) == 0
    assert dropped.any()
    torch.testing.assert_close(out[dropped], h[dropped])


@pytest.mark.parametrize("top_k", [1, 2])
def test_slots_hold_one_token_and_experts_respect_capacity(top_k: int) -> None:
    probs = F.softmax(torch.randn(3, 20, E), dim=-1)
    capacity = expert_capacity(20, E, top_k, 0.5)
    routing = route(probs, top_k, capacity)
    assert routing.dispatch.shape == (3, 20, E, capacity)
    assert routing.dispatch.sum(dim=1).max() <= 1  # one token per (expert, slot)
    per_token = routing.dispatch.sum(dim=(2, 3))
    assert per_token.max() <= top_k


def test_with_room_for_all_every_token_gets_k_experts_and_gates_sum_to_one() -> None:
    probs = F.softmax(torch.randn(2, 16, E), dim=-1)
    routing = route(probs, top_k=2, capacity=16)
    torch.testing.assert_close(routing.dispatch.sum(dim=(2, 3)), torch.full((2, 16), 2.0))
    torch.testing.assert_close(routing.combine.sum(dim=(2, 3)), torch.ones(2, 16))
    # Top-1 gates are the router probability itself (Switch Transformer).
    routing = route(probs, top_k=1, capacity=16)
    torch.testing.assert_close(routing.combine.sum(dim=(2, 3)), probs.max(dim=-1).values)


def test_capacity_formula() -> None:
    assert expert_capacity(4096, 8, 2, 1.25) == 1280  # ceil(1.25 * 2 * 4096 / 8)
    assert expert_capacity(16, 4, 2, 1.25) == 10
    assert expert_capacity(16, 4, 1, 0.1) == 1  # at least one slot
    assert expert_capacity(16, 4, 2, 100.0) == 16  # never more slots than tokens


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_weight_times_one_for_a_uniform_router(top_k: int) -> None:
    # Uniform probabilities: p_e = 1/E, sum_e f_e = 1, so E * sum_e f_e p_e = 1 per layer.
    model, (idx,) = build("moe-tiny", top_k=top_k, aux_loss_weight=0.5)
    with torch.no_grad():
        for layer in model.layers:
            layer.moe.router.weight.zero_()
    logits, aux_loss = model(idx)
    assert aux_loss.shape == ()
    torch.testing.assert_close(aux_loss, torch.tensor(0.5))
    assert torch.isfinite(logits).all()


def test_aux_loss_trains_the_router() -> None:
    model, (idx,) = build("moe-tiny")
    _, aux_loss = model(idx)
    assert aux_loss.shape == () and torch.isfinite(aux_loss) and aux_loss > 0
    aux_loss.backward()
    for layer in model.layers:
        assert layer.moe.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_groups_of_tokens_route_each_group_on_its_own(top_k: int) -> None:
    """group_size=8 cuts 2 sequences of 16 into 4 groups with their own capacity: the
    same as routing each group as a sequence of its own."""
    torch.manual_seed(0)
    model, _ = build("moe-tiny", top_k=top_k, capacity_factor=0.5, group_size=8)
    layer = model.layers[0].moe
    x = torch.randn(2, 16, D)
    with torch.no_grad():
        y, _ = layer(x)
        expected, dropped = loop_reference(layer, x.reshape(4, 8, D))
    assert dropped.any()  # capacity 1 or 2 per group of 8: some tokens overflow
    torch.testing.assert_close(y, expected.reshape(2, 16, D), rtol=1e-5, atol=1e-6)


def test_group_size_must_divide_the_tokens() -> None:
    model, (idx,) = build("moe-tiny", group_size=7)
    with pytest.raises(UsageError, match="group_size=7"):
        model(idx)


def test_switch_top1_gate_is_the_router_probability_and_gshard_top2_gates_sum_to_one() -> None:
    for top_k, expected in ((1, "max probability"), (2, "one")):
        layer = moe_layer(top_k, capacity_factor=100.0)  # room for every token
        x = torch.randn(2, 16, D)
        with torch.no_grad():
            routing, probs = layer.route_tokens(layer.groups(x))
        gates = routing.combine.sum(dim=(2, 3))
        want = probs.max(dim=-1).values if top_k == 1 else torch.ones_like(gates)
        torch.testing.assert_close(gates, want, msg=expected)


def hugging_face_mixtral(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """MixtralSparseMoeBlock.forward (transformers 4.x), with its data-dependent torch.where."""
    B, T, d = x.shape
    hidden = x.view(-1, d)
    routing_weights = F.softmax(block.gate(hidden), dim=1, dtype=torch.float)
    routing_weights, selected = torch.topk(routing_weights, block.top_k, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    final = torch.zeros_like(hidden)
    expert_mask = F.one_hot(selected, num_classes=block.n_experts).permute(2, 1, 0)
    for e in range(block.n_experts):
        idx, top_x = torch.where(expert_mask[e])
        current = hidden[None, top_x].reshape(-1, d)
        out = block.experts[e](current) * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, out)
    return final.reshape(B, T, d)


def test_sparse_block_without_drops_is_hugging_face_mixtral() -> None:
    torch.manual_seed(0)
    model, _ = build("mixtral-sparse-tiny")
    block = model.layers[0].moe
    assert block.capacity(2 * 16) == 2 * 16  # capacity_factor = E / k: room for all
    x = torch.randn(2, 16, D)
    with torch.no_grad():
        y, aux = block(x)
        torch.testing.assert_close(y, hugging_face_mixtral(block, x), rtol=1e-5, atol=1e-6)
    assert aux.shape == () and torch.isfinite(aux)


def test_sparse_block_with_small_capacity_keeps_each_experts_first_tokens() -> None:
    torch.manual_seed(0)
    model, _ = build("mixtral-sparse-tiny", capacity_factor=0.25)
    block = model.layers[0].moe
    x = torch.randn(2, 16, D)
    hidden = x.reshape(-1, D)
    capacity = block.capacity(32)
    with torch.no_grad():
        y, _ = block(x)
        probs = F.softmax(block.gate(hidden), dim=-1)
        weights, selected = probs.topk(2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        expected = torch.zeros_like(hidden)
        kept = [0] * 4
        for t in range(32):  # token order: an expert's first `capacity` tokens get in
            for i in range(2):
                e = int(selected[t, i])
                if kept[e] < capacity:
                    kept[e] += 1
                    expected[t] += weights[t, i] * block.experts[e](hidden[t])
    assert capacity < 16 and max(kept) == capacity  # some expert did overflow
    torch.testing.assert_close(y.reshape(-1, D), expected, rtol=1e-5, atol=1e-6)
