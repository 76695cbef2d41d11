"""A GPT-2 style decoder: learned positions, pre-LayerNorm blocks, GELU MLP, tied embeddings.

>>> model, (idx,) = gpt(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=32)
>>> model(idx).shape
torch.Size([1, 8, 64])

With ``bias=True`` and ``tie_embeddings=True`` the parameter count is Megatron's
``12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))`` plus ``2h`` for the final LayerNorm, which
that formula leaves out (124,439,808 for GPT-2 small).
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from autopar_examples.models._build import (
    Built,
    check_divides,
    check_positive,
    example_tokens,
    init_weights,
    is_meta,
    make_config,
    normalize_dtype,
)
from autopar_plans.errors import UsageError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    vocab_size: int
    """Number of token ids: rows of ``wte`` and outputs of ``lm_head``."""
    seq_len: int
    """Context length: rows of the learned position table ``wpe``; T of the example inputs."""
    n_layer: int
    """Number of transformer blocks in ``layers``."""
    n_head: int
    """Attention heads per block; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream (h)."""
    d_ff: int | None = None
    """Hidden width of the MLP; None means ``4 * d_model``, as in GPT-2 and GPT-3."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (training only)."""
    bias: bool = True
    """Biases in every Linear and LayerNorm except ``lm_head``, as GPT-2 has them."""
    tie_embeddings: bool = True
    """``lm_head.weight`` is ``wte.weight`` (one parameter)."""
    attention: str = "sdpa"
    """``"sdpa"``: ``scaled_dot_product_attention`` (a fused kernel keeps no T x T scores);
    ``"explicit"``: softmax(q k^T / sqrt(hs) + causal mask) v written out, as Megatron's
    core attention, whose T x T scores are what selective recomputation frees."""
    batch_size: int = 1
    """B of the example inputs."""
    device: str | torch.device = "cpu"
    """Where the weights live; "meta" builds shapes only and skips init."""
    dtype: torch.dtype | str = torch.float32
    """Dtype of the weights; a name such as "bfloat16" is accepted too."""

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        check_positive(self, "vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff")
        check_positive(self, "batch_size")
        check_divides(self, "n_head", "d_model")
        if self.attention not in ("sdpa", "explicit"):
            raise UsageError(
                f"GPTConfig.attention must be 'sdpa' or 'explicit', not {self.attention!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"GPTConfig.dropout must be in [0, 1), not {self.dropout!r}")
        normalize_dtype(self)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with one fused q/k/v projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.explicit = cfg.attention == "explicit"
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias, **factory)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        hs = C // self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        if self.explicit:
            scores = (q * hs**-0.5) @ k.transpose(-2, -1)  # (B, nh, T, T)
            mask = torch.full((T, T), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
            probs = _dropout(F.softmax(scores + mask, dim=-1), p, self.training)
            y = probs @ v  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return _dropout(self.proj(y), self.dropout, self.training)  # (B, T, C)


class MLP(nn.Module):
    """Linear d -> d_ff, GELU (tanh approximation, as GPT-2), Linear d_ff -> d."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        assert cfg.d_ff is not None  # resolved in GPTConfig.__post_init__
        self.dropout = cfg.dropout
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias, **factory)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x), approximate="tanh")  # (B, T, d_ff)
        return _dropout(self.proj(h), self.dropout, self.training)  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias, **factory)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias, **factory)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, output head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.seq_len = cfg.seq_len
        self.dropout = cfg.dropout
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model, **factory)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model, **factory)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias, **factory)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, **factory)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]  # idx: (B, T) token ids
        if self.seq_len < T:
            raise UsageError(f"GPT: sequence of {T} tokens is longer than seq_len={self.seq_len}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        x = _dropout(x, self.dropout, self.training)
        for layer in self.layers:
            x = layer(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def gpt(**config: object) -> Built:
    """Build a GPT from the fields of :class:`GPTConfig`; returns ``(model, (idx,))``."""
    cfg = make_config(GPTConfig, config)
    model = GPT(cfg)
    if not is_meta(cfg.device):
        init_weights(model, 2 * cfg.n_layer, residual=("attn.proj.weight", "mlp.proj.weight"))
    idx = example_tokens(cfg.batch_size, cfg.seq_len, cfg.vocab_size, cfg.device)
    return model, (idx,)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that adds no op to the traced graph when it would do nothing."""
    return F.dropout(x, p, training=True) if training and p > 0 else x
