"""What every example model shares: checked configs, weight init, example inputs.

A factory turns keyword arguments into a config with :func:`make_config`, so a misspelt key
is a :class:`~autopar_plans.errors.UsageError` that lists the valid keys (closest first) instead of
a ``TypeError`` from a dataclass constructor:

>>> from autopar_examples.models.gpt import GPTConfig
>>> make_config(GPTConfig, {"vocab_size": 8, "seq_len": 4, "n_layer": 1, "n_heads": 2})
Traceback (most recent call last):
    ...
autopar_plans.errors.UsageError: GPTConfig has no key 'n_heads'; valid keys: n_head, ...
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias, TypeVar

import torch
from torch import nn

from autopar_plans.errors import UsageError

ConfigT = TypeVar("ConfigT")

Built: TypeAlias = tuple[nn.Module, tuple[torch.Tensor, ...]]
"""What every factory returns: the model and the inputs for ``model(*example_inputs)``."""

INIT_STD = 0.02
"""Standard deviation of the normal init of every weight matrix and embedding (GPT-2)."""


def closest_first(word: str, choices: Iterable[str]) -> list[str]:
    """All ``choices``, the ones closest to ``word`` (difflib) first, the rest sorted.

    >>> closest_first("n_heads", ["d_model", "n_layer", "n_head"])
    ['n_head', 'd_model', 'n_layer']
    """
    ordered = sorted(choices)
    close = difflib.get_close_matches(word, ordered, n=3, cutoff=0.5)
    return close + [c for c in ordered if c not in close]


def make_config(cls: type[ConfigT], config: Mapping[str, Any]) -> ConfigT:
    """Build the dataclass ``cls`` from ``config``; wrong or missing keys are a UsageError."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in config:
        if key not in fields:
            valid = ", ".join(closest_first(key, fields))
            raise UsageError(f"{cls.__name__} has no key {key!r}; valid keys: {valid}")
    missing = [
        name
        for name, f in fields.items()
        if name not in config
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UsageError(f"{cls.__name__} needs a value for: {', '.join(missing)}")
    return cls(**config)


def check_positive(config: object, *names: str) -> None:
    """Raise UsageError unless each named field of ``config`` is an int > 0."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            kind = type(config).__name__
            raise UsageError(f"{kind}.{name} must be a positive int, not {value!r}")


def check_divides(config: object, divisor: str, dividend: str) -> None:
    """Raise UsageError unless field ``divisor`` divides field ``dividend``."""
    a, b = getattr(config, divisor), getattr(config, dividend)
    if b % a:
        raise UsageError(f"{type(config).__name__}: {divisor}={a} must divide {dividend}={b}")


def normalize_dtype(config: object) -> None:
    """Let ``config.dtype`` also be spelled as a string ("bfloat16"), as a CLI passes it."""
    value = config.dtype  # type: ignore[attr-defined]
    if isinstance(value, str):
        resolved = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise UsageError(f"{type(config).__name__}.dtype: unknown dtype {value!r}")
        object.__setattr__(config, "dtype", resolved)
    elif not isinstance(value, torch.dtype):
        raise UsageError(f"{type(config).__name__}.dtype must be a torch.dtype, not {value!r}")


def is_meta(device: str | torch.device) -> bool:
    """True for the meta device, on which models are built without allocating weights."""
    return torch.device(device).type == "meta"


@torch.no_grad()
def init_weights(model: nn.Module, n_residual: int, residual: tuple[str, ...] = ()) -> None:
    """Initialise ``model`` in place, deterministically given ``torch.manual_seed``.

    Weight matrices and embeddings ~ normal(0, 0.02); biases 0; norm gains 1. Parameters
    whose name ends with one of ``residual`` (the projections that write into the residual
    stream) get std 0.02 / sqrt(n_residual), as GPT-2 does with n_residual = 2 * n_layer.
    Tied parameters are visited once. Callers skip this on the meta device.
    """
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(param)
        elif param.ndim == 1:
            nn.init.ones_(param)
        else:
            std = INIT_STD / math.sqrt(n_residual) if name.endswith(residual) else INIT_STD
            nn.init.normal_(param, mean=0.0, std=std)


def example_tokens(
    batch_size: int, seq_len: int, vocab_size: int, device: str | torch.device
) -> torch.Tensor:
    """Token ids of shape (batch_size, seq_len), the same on every call (own generator).

    On the meta device the ids are a meta tensor: shapes only, nothing allocated.
    """
    if is_meta(device):
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size, (batch_size, seq_len), generator=generator)
    return ids.to(device)
