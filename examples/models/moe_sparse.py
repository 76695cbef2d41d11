"""Mixtral's sparse MoE block as Hugging Face writes it, at fixed shapes.

``transformers``' ``MixtralSparseMoeBlock`` flattens the tokens, routes them (linear,
softmax, top-k, gates renormalised), then loops over the experts: ``torch.where`` picks the
tokens routed to expert e, ``hidden[top_x]`` gathers them, the expert's MLP runs on them and
``index_add_`` adds its weighted output back into the token rows. How many tokens an expert
gets depends on the data, so ``torch.where`` gives a tensor of data-dependent length:
``torch.export`` traces it with an unbacked size, and autopar, which costs and shards fixed
shapes, refuses it at ``trace`` and names the line.

This block keeps Hugging Face's structure (its parameter names too: ``gate``,
``experts.{e}.w1/w2/w3``) and replaces only that one step with a fixed-size one: expert e
takes the first C tokens routed to it, in token order, found by ``topk`` over ``routed[:, e]
* (N - position)``; the slots left over hold some unrouted token with weight 0. The gates are
spread over (token, expert) with ``scatter``, the tokens picked with ``index_select`` and put
back with ``index_add``, as Hugging Face does. C is the capacity of :func:`expert_capacity`
over all N tokens of the batch (one group); with ``capacity_factor >= n_experts / top_k``,
C = N and no token is ever dropped, which is exactly Mixtral. With a smaller C a token
routed to a full expert is dropped from it (earlier tokens first, unlike GShard's first
choices first).

Expert weights here are separate modules, not one tensor with an expert dim, so the einsum
rules cannot shard experts over a mesh axis: this block plans with the slower strategies
its ops allow (tokens gathered, experts tensor-parallel or replicated).

>>> from autopar_examples.models.moe import moe
>>> model, (idx,) = moe(vocab_size=64, seq_len=8, n_layer=1, n_head=4, d_model=32,
...                     d_ff=64, n_experts=4, top_k=2, dispatch="index")
>>> logits, aux_loss = model(idx)
>>> logits.shape, aux_loss.shape
(torch.Size([1, 8, 64]), torch.Size([]))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar_examples.models.moe import MoEConfig, expert_capacity, load_balancing_loss


class ExpertMLP(nn.Module):
    """One SwiGLU expert, as Hugging Face's ``MixtralBlockSparseTop2MLP``: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, **factory)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False, **factory)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Router and per-expert MLPs; returns (y, balancing loss) like ``moe.MoE``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        factory = {"device": cfg.device, "dtype": cfg.dtype}
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False, **factory)
        self.experts = nn.ModuleList(ExpertMLP(cfg) for _ in range(cfg.n_experts))

    def capacity(self, tokens: int) -> int:
        return expert_capacity(tokens, self.n_experts, self.top_k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, d = x.shape
        hidden = x.reshape(-1, d)  # (N, d)
        N, E = hidden.shape[0], self.n_experts
        probs = F.softmax(self.gate(hidden).float(), dim=-1)  # (N, E)
        weights, selected = probs.topk(self.top_k, dim=-1)  # (N, k) each
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(1, selected, weights)  # (N, E), 0 if not chosen
        routed = torch.zeros_like(probs).scatter(1, selected, 1.0)  # (N, E) 0/1
        capacity = self.capacity(N)
        # earlier tokens score higher; unrouted tokens score 0 and fill only spare slots
        order = torch.arange(N, 0, -1, device=x.device, dtype=probs.dtype)  # (N,)
        y = torch.zeros_like(hidden)  # (N, d)
        for e, expert in enumerate(self.experts):
            # Hugging Face: idx, top_x = torch.where(expert_mask[e]), of data-dependent size
            score, top_x = (routed[:, e] * order).topk(capacity)  # (C,) each
            gate = gates[:, e].index_select(0, top_x) * (score > 0).to(probs.dtype)  # (C,)
            out = expert(hidden.index_select(0, top_x)) * gate[:, None].to(x.dtype)  # (C, d)
            y = y.index_add(0, top_x, out)  # (N, d)
        first_choice = (selected[:, :1] == torch.arange(E, device=x.device)).to(probs.dtype)
        aux = load_balancing_loss(probs.reshape(B, T, E), first_choice.reshape(B, T, E))
        return y.reshape(B, T, d), aux
