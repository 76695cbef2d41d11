"""LARS and LAMB on one device against the papers' algorithms written out plainly.

Each reference below is a per-parameter loop over the formulas of You, Gitman & Ginsburg
2017 (Algorithm 1) and You et al. 2019 (Algorithm 2); the optimizers under test use foreach
ops over lists and batched norms, so agreement to 1e-6 over several steps (with momentum,
weight decay, a learning rate that changes, and biases and norm gains left out) checks the
arithmetic, the state and the exclusion rule.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from autopar.optim import LAMB, LARS, global_norms, is_bias_or_norm, layerwise_groups

STEPS = 5
TOLERANCE = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _gradients(model: nn.Module, step: int) -> None:
    """A fresh batch's gradients (the same for every copy of the model at ``step``)."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=generator)
    y = torch.randn(16, 3, generator=generator)
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def _lr(step: int) -> float:
    """A learning rate that changes each step, as under a schedule."""
    return 0.05 * (step + 1)


# --- the references -------------------------------------------------------------------
def _lars_reference(
    params: list[nn.Parameter],
    buffers: list[torch.Tensor],
    lr: float,
    momentum: float,
    decay: float,
    eta: float,
    eps: float,
    excluded: list[bool],
) -> list[float]:
    """One LARS step, parameter by parameter; the trust ratios it used."""
    ratios = []
    with torch.no_grad():
        for w, v, out in zip(params, buffers, excluded, strict=True):
            g = w.grad
            if out:
                ratio, d = 1.0, g
            else:
                w_norm, g_norm = float(w.norm()), float(g.norm())
                ratio = 1.0
                if w_norm > 0 and g_norm > 0:
                    ratio = eta * w_norm / (g_norm + decay * w_norm + eps)
                d = g + decay * w
            v.mul_(momentum).add_(lr * ratio * d)
            w.sub_(v)
            ratios.append(ratio)
    return ratios


def _lamb_reference(
    params: list[nn.Parameter],
    moments: list[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    decay: float,
    excluded: list[bool],
) -> list[float]:
    """One LAMB step (``step`` counts from 1), parameter by parameter; the trust ratios."""
    beta1, beta2 = betas
    ratios = []
    with torch.no_grad():
        for w, (m, v), out in zip(params, moments, excluded, strict=True):
            g = w.grad
            m.mul_(beta1).add_((1 - beta1) * g)
            v.mul_(beta2).add_((1 - beta2) * g * g)
            m_hat = m / (1 - beta1**step)
            v_hat = v / (1 - beta2**step)
            r = m_hat / (v_hat.sqrt() + eps)
            ratio = 1.0
            if not out:
                r = r + decay * w
                w_norm, r_norm = float(w.norm()), float(r.norm())
                if w_norm > 0 and r_norm > 0:
                    ratio = w_norm / r_norm
            w.sub_(lr * ratio * r)
            ratios.append(ratio)
    return ratios


# --- running both ---------------------------------------------------------------------
def _run_lars(
    exclude_rule: Callable[[torch.Tensor], bool] | None, **options: float
) -> tuple[float, list[list[float]], list[list[float]]]:
    """LARS and the reference from the same model: the largest parameter difference at the
    end, and each one's trust ratios per step."""
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = LARS(model.parameters(), lr=_lr(0), exclude=exclude_rule, **options)
    params = list(reference.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    excluded = [exclude_rule is not None and exclude_rule(p) for p in params]
    got, want = [], []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step)
        _gradients(model, step)
        _gradients(reference, step)
        optimizer.step()
        ratios = optimizer.trust_ratios()
        got.append([ratios[p] for p in model.parameters()])
        want.append(
            _lars_reference(
                params,
                buffers,
                _lr(step),
                options["momentum"],
                options["weight_decay"],
                options["eta"],
                options["eps"],
                excluded,
            )
        )
    return _largest_gap(model, reference), got, want


def _run_lamb(
    exclude_rule: Callable[[torch.Tensor], bool] | None, **options: float
) -> tuple[float, list[list[float]], list[list[float]]]:
    model = _model()
    reference = copy.deepcopy(model)
    betas = (0.8, 0.95)
    optimizer = LAMB(model.parameters(), lr=_lr(0), betas=betas, exclude=exclude_rule, **options)
    params = list(reference.parameters())
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    excluded = [exclude_rule is not None and exclude_rule(p) for p in params]
    got, want = [], []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step)
        _gradients(model, step)
        _gradients(reference, step)
        optimizer.step()
        ratios = optimizer.trust_ratios()
        got.append([ratios[p] for p in model.parameters()])
        want.append(
            _lamb_reference(
                params,
                moments,
                step + 1,
                _lr(step),
                betas,
                options["eps"],
                options["weight_decay"],
                excluded,
            )
        )
    return _largest_gap(model, reference), got, want


def _largest_gap(model: nn.Module, reference: nn.Module) -> float:
    return max(
        float((a - b).detach().abs().max())
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


# --- the tests ------------------------------------------------------------------------
@pytest.mark.parametrize("rule", [is_bias_or_norm, None], ids=["exclude-vectors", "adapt-all"])
@pytest.mark.parametrize("decay", [0.0, 1e-2])
def test_lars_is_the_papers_algorithm(rule, decay) -> None:
    gap, got, want = _run_lars(rule, momentum=0.9, weight_decay=decay, eta=0.02, eps=1e-8)
    assert gap < TOLERANCE
    for step_got, step_want in zip(got, want, strict=True):
        assert step_got == pytest.approx(step_want, rel=TOLERANCE)
    assert any(r != 1.0 for r in got[-1])


@pytest.mark.parametrize("rule", [is_bias_or_norm, None], ids=["exclude-vectors", "adapt-all"])
@pytest.mark.parametrize("decay", [0.0, 1e-2])
def test_lamb_is_the_papers_algorithm(rule, decay) -> None:
    gap, got, want = _run_lamb(rule, weight_decay=decay, eps=1e-6)
    assert gap < TOLERANCE
    for step_got, step_want in zip(got, want, strict=True):
        assert step_got == pytest.approx(step_want, rel=TOLERANCE)


@pytest.mark.parametrize("make", [LARS, LAMB])
def test_excluded_parameters_take_trust_ratio_one_and_adapted_ones_do_not(make) -> None:
    model = _model()
    optimizer = make(model.parameters())
    _gradients(model, 0)
    optimizer.step()
    ratios = optimizer.trust_ratios()
    for name, param in model.named_parameters():
        if param.ndim == 1:  # biases and the LayerNorm's gain and bias
            assert ratios[param] == 1.0, name
        else:
            assert ratios[param] != 1.0, name


def test_excluded_parameters_take_no_weight_decay() -> None:
    """With a zero gradient, only weight decay could move an excluded parameter."""
    bias = nn.Parameter(torch.ones(4))
    weight = nn.Parameter(torch.ones(4, 4))
    optimizer = LARS([bias, weight], lr=1.0, weight_decay=0.5, eta=1.0)
    bias.grad = torch.zeros(4)
    weight.grad = torch.zeros(4, 4)
    optimizer.step()
    assert torch.equal(bias.detach(), torch.ones(4))
    # a zero gradient norm makes the weight's ratio 1: plain SGD with decay 0.5
    assert optimizer.trust_ratios()[weight] == 1.0
    assert torch.allclose(weight.detach(), torch.full((4, 4), 0.5))


def test_a_groups_exclude_flag_overrides_the_rule() -> None:
    model = _model()
    first, second = model[0], model[3]
    optimizer = LAMB(
        [
            {"params": first.parameters(), "exclude": True},  # its weight is left out too
            {"params": second.parameters(), "exclude": False},  # its bias is adapted too
        ]
    )
    _gradients(model, 0)
    optimizer.step()
    ratios = optimizer.trust_ratios()
    assert ratios[first.weight] == 1.0 and ratios[first.bias] == 1.0
    assert ratios[second.weight] != 1.0 and ratios[second.bias] != 1.0
    assert model[1].weight not in ratios  # not given to the optimizer


def test_zero_weights_fall_back_to_trust_ratio_one() -> None:
    """A zero-initialized layer: ``||w|| = 0`` would freeze it under the ratio."""
    weight = nn.Parameter(torch.zeros(3, 3))
    for optimizer in (LARS([weight]), LAMB([weight])):
        weight.grad = torch.ones(3, 3)
        optimizer.step()
        assert optimizer.trust_ratios()[weight] == 1.0
        assert weight.detach().abs().sum() > 0
        with torch.no_grad():
            weight.zero_()


def test_layerwise_groups_split_by_the_users_shape() -> None:
    model = _model()
    groups = layerwise_groups(model)
    adapted, excluded = groups
    assert adapted["exclude"] is False and excluded["exclude"] is True
    assert {id(p) for p in adapted["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert len(excluded["params"]) == 4  # two biases, the LayerNorm's gain and bias

    class Reshaped(nn.Module):
        """As a compiled model reports a parameter the planner reshaped."""

        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(3, 4))

        def user_shape(self, name: str) -> tuple[int, ...]:
            return (12,)

    (only,) = layerwise_groups(Reshaped())
    assert only["exclude"] is True
    (named,) = layerwise_groups(model, exclude=lambda name, shape: True)
    assert named["exclude"] is True


def test_state_is_what_the_memory_model_counts() -> None:
    """LARS keeps one buffer the size of the parameter, LAMB two (``cost_model.memory``)."""
    model = _model()
    for make, states in ((LARS, 1), (LAMB, 2)):
        optimizer = make(model.parameters())
        _gradients(model, 0)
        optimizer.step()
        for param in model.parameters():
            tensors = [
                t
                for t in optimizer.state[param].values()
                if isinstance(t, torch.Tensor) and t.shape == param.shape
            ]
            assert len(tensors) == states
            assert sum(t.numel() for t in tensors) == states * param.numel()


def test_the_state_round_trips_through_state_dict() -> None:
    model = _model()
    optimizer = LAMB(model.parameters(), lr=0.1)
    _gradients(model, 0)
    optimizer.step()
    again = copy.deepcopy(model)
    resumed = LAMB(again.parameters(), lr=0.1)
    # a copy, as a checkpoint read back is: torch's load keeps the given tensors as the state
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for m in (model, again):
        _gradients(m, 1)
    optimizer.step()
    resumed.step()
    assert _largest_gap(model, again) == 0.0


def test_global_norms_of_plain_tensors() -> None:
    tensors = [torch.full((3, 4), 2.0), torch.zeros(5), torch.ones(2, dtype=torch.bfloat16)]
    norms = global_norms(tensors)
    assert [float(n) for n in norms] == pytest.approx([math.sqrt(48.0), 0.0, math.sqrt(2.0)])
    assert all(n.dtype == torch.float32 for n in norms)


def test_bad_hyperparameters_are_refused() -> None:
    w = [nn.Parameter(torch.ones(2, 2))]
    with pytest.raises(ValueError, match="momentum"):
        LARS(w, momentum=-0.1)
    with pytest.raises(ValueError, match="eta"):
        LARS(w, eta=0.0)
    with pytest.raises(ValueError, match="betas"):
        LAMB(w, betas=(0.9, 1.0))
