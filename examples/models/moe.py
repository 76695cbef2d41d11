"""A mixture-of-experts decoder: Llama attention and norms, a top-k routed MoE in every block.

>>> model, (idx,) = moe(vocab_size=64, seq_len=8, n_layer=2, n_head=4, n_kv_head=2,
...                     d_model=32, d_ff=64, n_experts=4, top_k=2)
>>> logits, aux_loss = model(idx)
>>> logits.shape, aux_loss.shape
(torch.Size([1, 8, 64]), torch.Size([]))

Routing follows GShard (Lepikhin et al. 2020, Algorithm 1) with dense tensors of fixed
shape, so ``torch.export`` sees no data-dependent shape:

- the B x T tokens are cut into G groups of S consecutive tokens (``group_size``; default
  one sequence per group, G = B); capacity is per group and per expert,
  ``C = min(S, ceil(capacity_factor * top_k * S / n_experts))`` (more than S slots could
  never be filled: a token picks an expert at most once);
- a token's i-th choice takes the next free slot of its expert, first choices of the whole
  group before any second choice; a choice with no slot left is dropped: it contributes
  zero, and the token keeps only the residual if all its choices are dropped. Which tokens
  are dropped depends only on the group's router probabilities, never on the device;
- ``dispatch`` (G, S, E, C) is 1 where token s sits in slot c of expert e; ``combine`` is
  the same times the token's gate. ``top_k=1`` is Switch Transformer (the gate is the
  router probability); ``top_k=2`` is GShard's top-2 (the two gates renormalised to sum
  to 1, as GShard and Mixtral do; GShard's random second-expert dispatch is left out, so
  that routing is deterministic);
- dispatch and combine are GShard's einsums, ``gsec,gsd->egcd`` and ``gsec,egcd->gsd``, and
  the experts are stacked weights run as one batched matmul over the expert dim
  (``egcd,edf->egcf``). Nothing here names a parallelism: the einsum rules let a mesh axis
  shard the group dim g (data parallel) or the expert dim e (expert parallel), and going
  from one to the other between dispatch and experts is the all-to-all of expert
  parallelism (``docs/ARCHITECTURE.md``, "Mixture-of-experts").

``dispatch="index"`` swaps the block for Mixtral's sparse routing as Hugging Face writes it
(``autopar_examples.models.moe_sparse``).

The auxiliary load-balancing loss is Switch Transformer's (Fedus et al. 2021, eq. 4):
``E * sum_e f_e * p_e`` with f_e the fraction of tokens whose first choice is e and p_e the
mean router probability of e, averaged over layers, times ``aux_loss_weight``.

Parameters (untied): ``2 V h + h + l (2 h^2 + 2 h h_kv + E (3 h f + h) + 2 h)``;
46,702,792,704 for Mixtral 8x7B.
"""

import dataclasses
import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from autopar_examples.models._build import (
    Built,
    check_positive,
    example_tokens,
    init_weights,
    is_meta,
    make_config,
)
from autopar_examples.models.llama import Attention, LlamaConfig, RMSNorm
from autopar_plans.errors import UsageError

RESIDUAL_PROJECTIONS = ("attn.o_proj.weight", "experts.w_down")
"""Parameters that write into the residual stream; their init std is scaled down."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig(LlamaConfig):
    n_experts: int
    """Experts per MoE block (E)."""
    top_k: int = 2
    """Experts each token is sent to: 1 is Switch Transformer, 2 is GShard and Mixtral."""
    capacity_factor: float = 1.25
    """Slots per expert, as a multiple of a perfectly balanced share of top_k * T tokens."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer's alpha)."""
    group_size: int | None = None
    """Tokens per routing group (GShard's S): capacity and drops are per group. None: one
    sequence per group. Must divide batch x sequence length."""
    dispatch: Literal["einsum", "index"] = "einsum"
    """``einsum``: GShard's dense dispatch and combine (this module); ``index``: Mixtral's
    sparse block with index_select / index_add per expert (``moe_sparse``)."""

    def __post_init__(self) -> None:
        LlamaConfig.__post_init__(self)  # zero-argument super() fails in slotted dataclasses
        check_positive(self, "n_experts", "top_k")
        if self.top_k > self.n_experts:
            raise UsageError(f"MoEConfig: top_k={self.top_k} > n_experts={self.n_experts}")
        if self.capacity_factor <= 0 or self.aux_loss_weight < 0:
            raise UsageError("MoEConfig: capacity_factor must be > 0, aux_loss_weight >= 0")
        if self.group_size is not None and self.group_size < 1:
            raise UsageError(f"MoEConfig: group_size={self.group_size} must be >= 1")
        if self.dispatch not in ("einsum", "index"):
            raise UsageError(f"MoEConfig: dispatch={self.dispatch!r}: 'einsum' or 'index'")


class Routing(NamedTuple):
    """Where each token goes; shapes (G, S, E, C) but ``first_choice`` (G, S, E)."""

    dispatch: torch.Tensor
    """1.0 where token s occupies slot c of expert e, else 0.0."""
    combine: torch.Tensor
    """``dispatch`` times the token's gate for that expert."""
    first_choice: torch.Tensor
    """One-hot of each token's top-1 expert, before any drop (for the balancing loss)."""


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for a group of ``tokens`` tokens.

    >>> expert_capacity(4096, 8, 2, 1.25)
    1280
    """
    return max(1, min(tokens, math.ceil(capacity_factor * top_k * tokens / n_experts)))


def route(probs: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Dispatch and combine tensors for router probabilities ``probs`` (G, S, E).

    The dense formulation of GShard's Algorithm 1, for any top_k; see the module docstring.
    """
    G, S, E = probs.shape
    gates, experts = probs.topk(top_k, dim=-1)  # (G, S, k) each
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)  # (G, S, k)
    expert_ids = torch.arange(E, device=probs.device)  # (E,)
    slot_ids = torch.arange(capacity, device=probs.device)  # (C,)
    dispatch = probs.new_zeros(G, S, E, capacity)  # (G, S, E, C)
    combine = probs.new_zeros(G, S, E, capacity)  # (G, S, E, C)
    taken = torch.zeros(G, 1, E, dtype=torch.long, device=probs.device)  # slots used so far
    for i in range(top_k):
        chosen = (experts[..., i, None] == expert_ids).long()  # (G, S, E) one-hot
        position = taken + chosen.cumsum(dim=1) - 1  # (G, S, E) slot if kept
        kept = chosen * (position < capacity).long()  # (G, S, E)
        taken = taken + kept.sum(dim=1, keepdim=True)  # (G, 1, E)
        slot = (position[..., None] == slot_ids) & kept[..., None].bool()  # (G, S, E, C)
        dispatch = dispatch + slot.to(probs.dtype)
        combine = combine + slot.to(probs.dtype) * gates[..., i, None, None]
    first_choice = (experts[..., 0, None] == expert_ids).to(probs.dtype)  # (G, S, E)
    return Routing(dispatch, combine, first_choice)


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's ``E * sum_e f_e * p_e`` over all tokens of ``probs`` and
    ``first_choice`` (both (G, S, E)); 0-d; 1.0 if balanced."""
    E = probs.shape[-1]
    f = first_choice.mean(dim=(0, 1))  # (E,) fraction of tokens whose first choice is e
    p = probs.mean(dim=(0, 1))  # (E,) mean router probability of e
    return E * (f * p).sum()


class Experts(nn.Module):
    """E SwiGLU MLPs as stacked weights: w_gate, w_up (E, d, f) and w_down (E, f, d)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        E, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.w_gate = nn.Parameter(torch.empty(E, d, f, **factory))
        self.w_up = nn.Parameter(torch.empty(E, d, f, **factory))
        self.w_down = nn.Parameter(torch.empty(E, f, d, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (E, G, C, d), the tokens in each expert's slots
        gate = torch.einsum("egcd,edf->egcf", x, self.w_gate)  # (E, G, C, f)
        up = torch.einsum("egcd,edf->egcf", x, self.w_up)  # (E, G, C, f)
        return torch.einsum("egcf,efd->egcd", F.silu(gate) * up, self.w_down)  # (E, G, C, d)


class MoE(nn.Module):
    """Router, top-k dispatch with capacity, experts, combine; returns (y, balancing loss)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor, self.group_size = cfg.capacity_factor, cfg.group_size
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False, **factory)
        self.experts = Experts(cfg)

    def groups(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) as G groups of S consecutive tokens: (G, S, d)."""
        B, T, d = x.shape
        S = self.group_size or T
        if (B * T) % S:
            raise UsageError(f"MoE: group_size={S} does not divide {B} x {T} tokens")
        return x.reshape(B * T // S, S, d)

    def route_tokens(self, groups: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """Routing of ``groups`` (G, S, d) and the router probabilities (G, S, E), float32."""
        probs = F.softmax(self.router(groups).float(), dim=-1)  # (G, S, E)
        S = groups.shape[1]
        capacity = expert_capacity(S, self.n_experts, self.top_k, self.capacity_factor)
        return route(probs, self.top_k, capacity), probs

    def dispatch_and_combine(self, groups: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Each token's gated sum of its experts' outputs: (G, S, d); 0 if all dropped."""
        dispatch = routing.dispatch.to(groups.dtype)  # (G, S, E, C)
        combine = routing.combine.to(groups.dtype)  # (G, S, E, C)
        expert_in = torch.einsum("gsec,gsd->egcd", dispatch, groups)  # (E, G, C, d)
        expert_out = self.experts(expert_in)  # (E, G, C, d)
        return torch.einsum("gsec,egcd->gsd", combine, expert_out)  # (G, S, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups = self.groups(x)  # (G, S, d)
        routing, probs = self.route_tokens(groups)  # (G, S, E, C) tensors; (G, S, E)
        y = self.dispatch_and_combine(groups, routing)  # (G, S, d)
        return y.reshape(x.shape), load_balancing_loss(probs, routing.first_choice)


def moe_layer(cfg: MoEConfig) -> nn.Module:
    """The MoE layer ``cfg.dispatch`` names: :class:`MoE`, or Mixtral's sparse block."""
    if cfg.dispatch == "index":
        from autopar_examples.models.moe_sparse import SparseMoE  # it imports this module

        return SparseMoE(cfg)
    return MoE(cfg)


class MoEBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + moe(mlp_norm(x))."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **factory)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **factory)
        self.moe = moe_layer(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))  # (B, T, C)
        y, aux_loss = self.moe(self.mlp_norm(x))  # (B, T, C), ()
        return x + y, aux_loss


class MoETransformer(nn.Module):
    """Token embeddings, ``n_layer`` MoE blocks, final RMSNorm, output head."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.aux_loss_weight = cfg.aux_loss_weight
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, **factory)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, **factory)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, **factory)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed_tokens(idx)  # (B, T, C)
        aux_losses = []
        for layer in self.layers:
            x, aux_loss = layer(x)  # (B, T, C), ()
            aux_losses.append(aux_loss)
        aux_loss = torch.stack(aux_losses).mean() * self.aux_loss_weight  # ()
        return self.lm_head(self.norm(x)), aux_loss  # (B, T, V), ()


def moe(**config: object) -> Built:
    """Build an MoE transformer from :class:`MoEConfig`; returns ``(model, (idx,))``.

    ``model(idx)`` returns ``(logits, aux_loss)``: add ``aux_loss`` to the training loss.
    """
    cfg = make_config(MoEConfig, config)
    model = MoETransformer(cfg)
    if not is_meta(cfg.device):
        init_weights(model, 2 * cfg.n_layer, residual=RESIDUAL_PROJECTIONS)
    idx = example_tokens(cfg.batch_size, cfg.seq_len, cfg.vocab_size, cfg.device)
    return model, (idx,)
