"""A Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases.

>>> model, (idx,) = llama(vocab_size=64, seq_len=8, n_layer=2, n_head=4, n_kv_head=2,
...                       d_model=32, d_ff=64)
>>> model(idx).shape
torch.Size([1, 8, 64])

The model holds no buffers: the rotary angles are computed in ``forward`` from
``torch.arange``, so a model built on meta and materialised later (``to_empty`` + a state
dict) is complete, and a trace does not depend on buffer contents.

Parameters (untied): ``2 V h + h + l (2 h^2 + 2 h h_kv + 3 h f + 2 h)`` with
``h_kv = n_kv_head * h / n_head``; 8,030,261,248 for Llama 3 8B.
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

RESIDUAL_PROJECTIONS = ("attn.o_proj.weight", "mlp.down_proj.weight")
"""Parameters that write into the residual stream; their init std is scaled down."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    vocab_size: int
    """Number of token ids: rows of ``embed_tokens`` and outputs of ``lm_head``."""
    seq_len: int
    """Context length: T of the example inputs (positions are rotary, no table)."""
    n_layer: int
    """Number of transformer blocks in ``layers``."""
    n_head: int
    """Query heads per block; must divide ``d_model``."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); must divide ``n_head``. None: ``n_head``."""
    d_model: int
    """Width of the residual stream (h)."""
    d_ff: int
    """Hidden width of the SwiGLU MLP (f)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Llama 3 uses 500000)."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm's square root."""
    tie_embeddings: bool = False
    """``lm_head.weight`` is ``embed_tokens.weight`` (one parameter)."""
    batch_size: int = 1
    """B of the example inputs."""
    device: str | torch.device = "cpu"
    """Where the weights live; "meta" builds shapes only and skips init."""
    dtype: torch.dtype | str = torch.float32
    """Dtype of the weights; a name such as "bfloat16" is accepted too."""

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        check_positive(self, "vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head")
        check_positive(self, "d_model", "d_ff", "batch_size")
        check_divides(self, "n_head", "d_model")
        check_divides(self, "n_kv_head", "n_head")
        if (self.d_model // self.n_head) % 2:
            raise UsageError(f"{type(self).__name__}: rotary embeddings need an even head size")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise UsageError(f"{type(self).__name__}: rope_theta and norm_eps must be > 0")
        normalize_dtype(self)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in float32."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary_angles(
    seq_len: int, head_size: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (T, hs), float32, from ``torch.arange``.

    Dim pair (i, i + hs/2) at position t turns by ``t * theta^(-2i/hs)`` (the "rotate half"
    layout of the Hugging Face port; Meta's code pairs adjacent dims instead: a fixed
    permutation of q/k weights, the same model).
    """
    steps = torch.arange(0, head_size, 2, device=device, dtype=torch.float32)  # (hs/2,)
    inv_freq = 1.0 / theta ** (steps / head_size)  # (hs/2,)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    angles = torch.outer(pos, inv_freq)  # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k (B, nh, T, hs) by the angles (T, hs)."""
    x32 = x.float()  # (B, nh, T, hs)
    x1, x2 = x32.chunk(2, dim=-1)  # 2 x (B, nh, T, hs/2)
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, nh, T, hs)
    return (x32 * cos + rotated * sin).to(x.dtype)  # (B, nh, T, hs)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv, T, hs) -> (B, n_kv * n_rep, T, hs): query head j reads kv head j // n_rep."""
    if n_rep == 1:
        return x
    B, n_kv, T, hs = x.shape
    x = x[:, :, None].expand(B, n_kv, n_rep, T, hs)  # (B, n_kv, n_rep, T, hs)
    return x.reshape(B, n_kv * n_rep, T, hs)  # (B, nh, T, hs)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions on q and k."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        assert cfg.n_kv_head is not None  # resolved in LlamaConfig.__post_init__
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_size = cfg.d_model // cfg.n_head
        self.rope_theta = cfg.rope_theta
        d, d_kv = cfg.d_model, cfg.n_kv_head * self.head_size
        self.q_proj = nn.Linear(d, d, bias=False, **factory)
        self.k_proj = nn.Linear(d, d_kv, bias=False, **factory)
        self.v_proj = nn.Linear(d, d_kv, bias=False, **factory)
        self.o_proj = nn.Linear(d, d, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_size
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        # Computed per layer so that each block depends on nothing but its input.
        cos, sin = rotary_angles(T, hs, self.rope_theta, x.device)  # (T, hs) each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)  # (B, nh, T, hs) each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.o_proj(y)  # (B, T, C)


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, **factory)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, **factory)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, d_ff)
        return self.down_proj(h)  # (B, T, C)


class Block(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **factory)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **factory)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class Llama(nn.Module):
    """Token embeddings, ``n_layer`` blocks, final RMSNorm, output head."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, **factory)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, **factory)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, **factory)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)  # (B, T, C)
        return self.lm_head(self.norm(x))  # (B, T, V)


def llama(**config: object) -> Built:
    """Build a Llama from the fields of :class:`LlamaConfig`; returns ``(model, (idx,))``."""
    cfg = make_config(LlamaConfig, config)
    model = Llama(cfg)
    if not is_meta(cfg.device):
        init_weights(model, 2 * cfg.n_layer, residual=RESIDUAL_PROJECTIONS)
    idx = example_tokens(cfg.batch_size, cfg.seq_len, cfg.vocab_size, cfg.device)
    return model, (idx,)
