"""Sharding rules: attention family.

=============================================  =================================================
op                                             what a mesh axis may shard
=============================================  =================================================
scaled_dot_product_attention                   a batch dim or the head dim of q, k, v, mask, out
_scaled_dot_product_flash_attention_for_cpu    the same, and logsumexp along with the output
=============================================  =================================================

Attention is ``out[..., l, :] = softmax_s(q[..., l, :] . k[..., s, :] * scale + mask[l, s]) @ v``
computed independently for every index of the leading dims (``[B, H]`` in the usual
``[B, H, L, E]`` layout). So a mesh axis may split one leading dim of every tensor, and
nothing else:

- the batch dim of ``q``, ``k``, ``v``, the output and the mask (a tensor whose size there
  is 1, or that lacks the dim, broadcasts and stays ``Replicate``);
- the head dim, the same way. With grouped-query attention (``enable_gqa``; ``Hq = G * Hkv``)
  query head ``h`` reads key/value head ``h // G``. Cutting ``Hq`` and ``Hkv`` into the same
  number ``n`` of contiguous chunks keeps each pair on one device: device ``i`` holds query
  heads ``i*Hq/n + j`` and key heads ``i*Hkv/n + j // G``, and ``(i*G*Hkv/n + j) // G =
  i*Hkv/n + j // G``. It needs ``n`` to divide ``Hkv`` (and so ``Hq``), which ``combine``'s
  divisibility check enforces; e.g. ``Hq=8, Hkv=2`` splits over 2 devices, never over 4.

Never sharded: ``L`` (a causal mask is built from *local* positions, and the query rows of a
sharded ``L`` would not line up with it), ``S`` (the softmax normalises over all of ``S``),
``E`` (the scores sum over ``E`` inside a nonlinear softmax, so no ``Partial`` either). No
input is ever ``Partial``: attention is not linear in ``q`` or ``k``.

Dropout: with ``dropout_p > 0`` the op draws a random keep-mask. Each device draws the mask
of its own shard from its own generator, so the result is a valid dropout but not the bits
the unsharded op would draw, and devices that replicate an axis agree only if their
generators are seeded alike. This family does not manage that RNG state (the pointwise
family's ``"dropout"`` local kind does it for ``aten.dropout``); the brute-force tests run
with ``dropout_p = 0``.

The CUDA-only ops ``_scaled_dot_product_flash_attention`` and
``_scaled_dot_product_efficient_attention`` have no rule (replicated): they cannot run on
CPU, so their strategies could not be brute-forced. ``torch.export`` keeps
``scaled_dot_product_attention`` itself, which is the op traces hold.
"""

from __future__ import annotations

import torch

from autopar_passes.annotation import TensorInfo
from autopar_passes.strategies.combine import AxisChoice, combine, replicate_choice
from autopar_passes.strategies.types import LocalKind, OpCall, Rule, Strategy
from autopar_plans.placement import REPLICATE, Placement, Shard

aten = torch.ops.aten

KEY, VALUE = 1, 2  # positions of key and value in call.inputs


def sdpa_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """``scaled_dot_product_attention(q, k, v, attn_mask=None, ..., enable_gqa=False)``.

    Shards one leading (batch or head) dim per mesh axis; ``L``, ``S`` and ``E`` never (see
    the module docstring). Key and value heads may differ from query heads only with
    ``enable_gqa``.
    """
    enable_gqa = bool(call.kwargs.get("enable_gqa", False))
    return combine(_leading_dim_choices(call, grouped=enable_gqa), call, mesh_shape)


def flash_attention_cpu_rule(call: OpCall, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, ..., attn_mask=None) ->
    (out [B, H, L, Ev], logsumexp [B, H, L])``: as ``sdpa_rule``, with ``logsumexp`` split
    on the same leading dim as the output. The CPU kernel groups query heads by itself
    when ``Hq != Hkv``, so grouped heads are allowed as with ``enable_gqa``."""
    return combine(_leading_dim_choices(call, grouped=True), call, mesh_shape)


def _leading_dim_choices(call: OpCall, grouped: bool) -> list[AxisChoice]:
    """Per mesh axis: replicate, or split one leading dim of the output (every dim but the
    last two) together with that dim of every input that has it with size > 1.

    All outputs share the output's leading dims (``out`` and ``logsumexp``). A leading
    dim is left alone when some input holds a different size there that is not 1, except
    the head dim (the last leading dim) of key and value under ``grouped``.
    """
    out = call.outputs[0].shape
    n_lead = len(out) - 2
    choices = [replicate_choice(len(call.inputs), len(call.outputs))]
    for position in range(n_lead):
        if out[position] == 1:
            continue
        placements: list[Placement] = []
        for index, info in enumerate(call.inputs):
            group = grouped and index in (KEY, VALUE) and position == n_lead - 1
            placement = _input_placement(info, n_lead, position, out[position], group)
            if placement is None:
                break
            placements.append(placement)
        else:
            outputs = tuple(Shard(position) for _ in call.outputs)
            choices.append(AxisChoice(tuple(placements), outputs, tag=f"lead:{position}"))
    return choices


def _input_placement(
    info: TensorInfo, n_lead: int, position: int, size: int, group: bool
) -> Placement | None:
    """How an input follows the output split on leading dim ``position`` (of ``n_lead``,
    counted from the left). Inputs align with the output from the right, their last two
    dims being ``(L or S, E)`` or, for a mask, ``(L, S)``; a missing or size-1 dim
    broadcasts (``Replicate``). ``None``: the split cannot be followed."""
    own_lead = max(len(info.shape) - 2, 0)
    dim = position - (n_lead - own_lead)
    if dim < 0 or info.shape[dim] == 1:
        return REPLICATE
    if info.shape[dim] == size or (group and size % info.shape[dim] == 0):
        return Shard(dim)
    return None


RULES: dict[object, Rule] = {
    aten.scaled_dot_product_attention.default: sdpa_rule,
    aten._scaled_dot_product_flash_attention_for_cpu.default: flash_attention_cpu_rule,
}
LOCALS: dict[str, LocalKind] = {}
