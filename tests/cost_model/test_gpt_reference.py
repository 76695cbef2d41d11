"""GPT closed forms of Narayanan et al. 2021 against counts made by hand, layer by layer."""

from __future__ import annotations

import pytest

from autopar_cost_model import gpt_flops_per_iteration, gpt_params, matmul_flops


def gemm_flops_forward(B: int, s: int, l: int, h: int, V: int) -> int:  # noqa: E741
    """Forward GEMM FLOPs of a GPT, one matmul at a time (2 m k n each)."""
    tokens = B * s
    per_layer = (
        matmul_flops(tokens, h, 3 * h)  # QKV projection
        + matmul_flops(s, h, s, batch=B)  # attention scores Q K^T (all heads: h wide)
        + matmul_flops(s, s, h, batch=B)  # attention over values
        + matmul_flops(tokens, h, h)  # output projection
        + matmul_flops(tokens, h, 4 * h)  # MLP up
        + matmul_flops(tokens, 4 * h, h)  # MLP down
    )
    logits = matmul_flops(tokens, h, V)
    return l * per_layer + logits


CONFIGS = [(2, 128, 2, 64, 1000), (4, 512, 3, 256, 5000), (512, 2048, 24, 2304, 51200)]


@pytest.mark.parametrize(("B", "s", "l", "h", "V"), CONFIGS)
def test_flops_formula_equals_the_gemm_count(B, s, l, h, V):  # noqa: E741
    forward = gemm_flops_forward(B, s, l, h, V)
    # backward = 2 x forward, so one iteration = 3 forwards
    assert gpt_flops_per_iteration(B, s, l, h, V) == pytest.approx(3 * forward, rel=1e-12)


@pytest.mark.parametrize(("B", "s", "l", "h", "V"), CONFIGS)
def test_flops_with_recompute_add_one_forward_of_the_layers(B, s, l, h, V):  # noqa: E741
    forward = gemm_flops_forward(B, s, l, h, V)
    logits = matmul_flops(B * s, h, V)  # the logits are not recomputed
    expected = 3 * forward + (forward - logits)
    assert gpt_flops_per_iteration(B, s, l, h, V, recompute=True) == pytest.approx(
        expected, rel=1e-12
    )


@pytest.mark.parametrize(
    ("h", "l", "billions"),
    [(2304, 24, 1.7), (4096, 36, 7.5), (12288, 80, 145.6), (25600, 128, 1008.0)],
)
def test_params_match_megatron_table_1(h, l, billions):  # noqa: E741
    # Narayanan et al. 2021, Table 1 (V = 51200, s = 2048)
    assert round(gpt_params(l, h, 51200, 2048) / 1e9, 1) == billions


def test_params_formula_equals_a_count_by_hand():
    l, h, V, s = 3, 64, 1000, 128  # noqa: E741
    per_layer = (
        h * 3 * h
        + 3 * h  # QKV weight and bias
        + h * h
        + h  # projection
        + h * 4 * h
        + 4 * h  # MLP up
        + 4 * h * h
        + h  # MLP down
        + 2 * 2 * h  # two layer norms, scale and shift
    )
    embeddings = V * h + s * h
    assert gpt_params(l, h, V, s) == pytest.approx(l * per_layer + embeddings)
