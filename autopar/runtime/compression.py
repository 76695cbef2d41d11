"""Compressed gradient sums: encode each device's gradients, move the encoding, decode.

``Compressor.reduce`` sums a bucket of fp32 gradients over the replicating mesh axes (one
``AxisGroup`` each, summed over each in turn) by the scheme of a ``GradCompression``,
issuing exactly the collectives ``autopar_plans.compression.compressed_calls`` lists, in its
order, each through an ``AxisGroup`` so the ``CommLog`` records it. Every rank decodes the
same bytes by the same arithmetic in the same order, so the result is bit-identical on every
rank (replicated parameters stay bit-equal).

Sums, not averages: ``n`` devices holding ``g_d`` get ``sum_d g_d`` (approximately).

terngrad (Wen et al. 2017, arXiv 1705.07878)
    Per tensor, ``s = max_d max|g_d|`` (all-reduce MAX, "scaler sharing"); each device sends
    ``b = sign(g) * Bernoulli(|g| / s)`` in {-1, 0, 1}; the sum is ``s * sum_d b_d``. Since
    ``E[s b] = g``, it is unbiased; its variance per value is ``sum_d (s |g_d| - g_d^2)``.
topk (Lin et al. 2018, Deep Gradient Compression, arXiv 1712.01887)
    Error feedback ``v <- v + g`` (with momentum correction ``u <- m u + g; v <- v + u``),
    send the ``k`` largest ``|v|`` and zero them in ``v`` (and ``u``: momentum factor
    masking). Whatever is not sent now is sent later: ``sum_t sent_t = sum_t g_t - v_T``.
block_topk (Sun et al. 2019, arXiv 1902.06855)
    As topk, with blocks of ``block`` values chosen by their L2 norm, one index per block.
powersgd (Vogels et al. 2019, arXiv 1905.13727)
    Per matrix, ``M = G + e``; ``P = sum_d M_d Q``; orthonormalise ``P``; ``Q' = sum_d M_d^T
    P``; the sum is ``P Q'^T = P P^T sum_d M_d``, a rank-r projection of the true sum.
    Each device keeps ``e_d = M_d - P (M_d^T P)^T``, its own projection residual (the
    paper's Algorithm 2). torch's ``powerSGD_hook`` keeps ``M_d - (P Q'^T) / n`` instead:
    the errors sum to the same ``sum_d M_d - P Q'^T``, so the sums sent are the same, but
    there each ``e_d`` also accumulates ``g_d - mean_d g_d`` step after step, a drift that
    cancels only in the sum (and costs fp32 digits). ``Q'`` warm-starts the next call.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.runtime.collectives import all_gather_rows
from autopar.runtime.comm import AxisGroup
from autopar_plans.compression import GradCompression, level_dtype, matrix_shape

LEVEL_DTYPES = {"int8": torch.int8, "int32": torch.int32}


# ---------------------------------------------------------------- pure encodings


def clip_to_rms(flat: torch.Tensor, clip: float) -> torch.Tensor:
    """TernGrad's gradient clipping: ``g`` clamped to ``[-c sigma, c sigma]``.

    The interval is centred at zero, so ``sigma`` is measured about zero, the root mean
    square ``sqrt(mean(g^2))``: the paper's standard deviation for the zero-mean gradients
    it assumes, and unlike the standard deviation it never clips a constant (or one-value)
    gradient to zero."""
    bound = clip * flat.square().mean().sqrt()
    return torch.maximum(torch.minimum(flat, bound), -bound)


def ternarize(flat: torch.Tensor, scale: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Stochastic ternary levels of ``flat`` under ``scale >= max|flat|`` (int8):
    ``sign(g)`` with probability ``|g| / scale``, else 0, so ``E[scale * level] = g``."""
    draw = torch.rand(flat.shape, generator=generator, device=flat.device, dtype=flat.dtype)
    probability = flat.abs() / scale.clamp_min(torch.finfo(flat.dtype).tiny)
    return (torch.sign(flat) * (draw < probability)).to(torch.int8)


def select_topk(residual: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest ``|residual|`` (1-D), ascending (a fixed order)."""
    return residual.abs().topk(k, sorted=False).indices.sort().values


def select_blocks(residual: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Indices of the ``k`` blocks of ``block`` values (the last padded with zeros) of the
    largest L2 norm in 1-D ``residual``, ascending."""
    norms = pad_to_blocks(residual, block).square().sum(dim=1)
    return norms.topk(k, sorted=False).indices.sort().values


def pad_to_blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` as ``[ceil(numel / block), block]``, zero-padded at the end (a copy)."""
    blocks = math.ceil(flat.numel() / block)
    padded = flat.new_zeros(blocks * block)
    padded[: flat.numel()] = flat
    return padded.view(blocks, block)


def scatter_rows(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (zeroed, ``[slots, ...]``) plus, row after row, each device's ``values``
    (``[n, k, ...]``) at its ``indices`` (``[n, k]``, unique within a row).

    One ``index_add_`` per device row: within a row no slot is hit twice, so each slot's sum
    is taken in device order 0, 1, ..., n-1 however the kernel schedules its adds (on a GPU
    with atomics too), the same on every rank."""
    for row_values, row_indices in zip(values.unbind(0), indices.unbind(0), strict=True):
        out.index_add_(0, row_indices.long(), row_values)
    return out


def orthonormalize(p: torch.Tensor, eps: float = 1e-30) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``p`` ``[rows, r]``, in place.

    Deterministic column by column, so ranks holding the same ``p`` get the same result;
    a zero column (a vanishing gradient) stays zero instead of dividing by zero (torch's
    ``powerSGD_hook`` adds an epsilon to the norm for the same reason)."""
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col /= col.norm().clamp_min(eps)
        rest = p[:, i + 1 :]
        rest -= col * (col.T @ rest)
    return p


def draw_seed(seed: int, offset: int, step: int) -> int:
    """A generator seed for (seed, rank offset, step), hashed: ``seed + offset + step``
    would give rank 1 at step 0 rank 0's draws of step 1, correlating the devices."""
    digest = hashlib.blake2b(f"{seed}/{offset}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ---------------------------------------------------------------- the compressor


@dataclass
class _State:
    """What one gradient keeps between calls (fp32): error feedback, DGC's velocity,
    PowerSGD's warm-start ``Q``."""

    shape: torch.Size
    residual: torch.Tensor | None = None
    velocity: torch.Tensor | None = None
    q: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.residual, self.velocity, self.q) if t is not None]


class Compressor:
    """Sums buckets of fp32 gradients by an encoding scheme, keeping per-gradient state.

    ``seed_offset`` (the global rank, say) makes TernGrad's draws independent across
    devices; PowerSGD's initial ``Q`` ignores it (it must be the same on every rank)."""

    def __init__(self, scheme: GradCompression, seed_offset: int = 0) -> None:
        if not scheme.encodes:
            raise ValueError(f"{scheme.scheme!r} is not an encoding: the sync casts instead")
        self.scheme = scheme
        self.seed_offset = seed_offset
        self.step = 0
        self._states: dict[Hashable, _State] = {}
        self._init = torch.Generator().manual_seed(scheme.seed)

    def reduce(
        self, grads: list[torch.Tensor], groups: Sequence[AxisGroup], keys: Sequence[Hashable]
    ) -> list[torch.Tensor]:
        """The (approximate) sum of each of ``grads`` over every device of ``groups`` (one
        mesh axis each), as new fp32 tensors, bit-identical on every rank; each gradient's
        state is kept under its key. No groups: this device's own encoding, decoded.

        Every rank must call it with the same keys and shapes in the same order (the
        collectives pair up, and PowerSGD draws its first ``Q`` in that order)."""
        if len(grads) != len(keys):
            raise ValueError(f"{len(grads)} gradients but {len(keys)} keys")
        if not grads:
            return []
        for grad in grads:
            if grad.dtype != torch.float32:
                raise TypeError(f"compressed sums take fp32 gradients, not {grad.dtype}")
        states = [self._state(key, grad) for key, grad in zip(keys, grads, strict=True)]
        run = {
            "terngrad": self._terngrad,
            "topk": self._topk,
            "block_topk": self._block_topk,
            "powersgd": self._powersgd,
        }[self.scheme.scheme]
        out = run([g.detach() for g in grads], list(groups), states)
        self.step += 1
        return [o.view(g.shape) for o, g in zip(out, grads, strict=True)]

    def state_bytes(self) -> int:
        """Bytes of state held now: ``4 * sum(state_values(scheme, shape))`` over the
        gradients seen."""
        return sum(t.numel() * t.element_size() for s in self._states.values() for t in s.tensors())

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The error-feedback residual kept for ``key`` (what was not sent yet), if any."""
        state = self._states.get(key)
        return None if state is None else state.residual

    def _state(self, key: Hashable, grad: torch.Tensor) -> _State:
        state = self._states.get(key)
        if state is not None:
            if state.shape != grad.shape:
                raise ValueError(f"gradient {key!r} was {tuple(state.shape)}, now {grad.shape}")
            return state
        state = _State(grad.shape)
        name = self.scheme.scheme
        if name in ("topk", "block_topk", "powersgd"):
            state.residual = torch.zeros(grad.numel(), device=grad.device)
        if name == "topk" and self.scheme.momentum:
            state.velocity = torch.zeros(grad.numel(), device=grad.device)
        if name == "powersgd":
            rows, cols = matrix_shape(grad.shape)
            if self.scheme.rank > rows:
                raise ValueError(f"rank {self.scheme.rank} exceeds the {rows} rows of {key!r}")
            # drawn in the order gradients are first seen, the same on every rank
            q = torch.randn(cols, self.scheme.rank, generator=self._init)
            state.q = q.to(grad.device)
        self._states[key] = state
        return state

    # terngrad ------------------------------------------------------------------------

    def _terngrad(
        self, grads: list[torch.Tensor], groups: list[AxisGroup], states: list[_State]
    ) -> list[torch.Tensor]:
        """Scales (all-reduce MAX, each axis), then levels (all-reduce SUM, each axis)."""
        flats = [g.reshape(-1) for g in grads]
        if self.scheme.clip is not None:
            flats = [clip_to_rms(f, self.scheme.clip) for f in flats]
        scales = torch.stack([f.abs().max() for f in flats])  # [tensors] fp32
        for group in groups:
            group.all_reduce(scales, op=dist.ReduceOp.MAX)
        generator = torch.Generator(device=grads[0].device)
        generator.manual_seed(draw_seed(self.scheme.seed, self.seed_offset, self.step))
        devices = math.prod(group.size for group in groups)
        levels = torch.cat([ternarize(f, s, generator) for f, s in zip(flats, scales, strict=True)])
        levels = levels.to(LEVEL_DTYPES[level_dtype(devices)])
        for group in groups:
            group.all_reduce(levels)
        counts = levels.split([f.numel() for f in flats])
        return [c.float() * s for c, s in zip(counts, scales, strict=True)]

    # topk and block_topk -------------------------------------------------------------

    def _topk(
        self, grads: list[torch.Tensor], groups: list[AxisGroup], states: list[_State]
    ) -> list[torch.Tensor]:
        """Accumulate, pick, gather values and indices (each axis), scatter-add."""
        values, indices, offset = [], [], 0
        for grad, state in zip(grads, states, strict=True):
            residual = self._accumulate(grad, state)
            chosen = select_topk(residual, self.scheme.kept(grad.numel()))
            values.append(residual[chosen])
            indices.append((chosen + offset).to(torch.int32))
            residual[chosen] = 0.0
            if state.velocity is not None:
                state.velocity[chosen] = 0.0  # momentum factor masking
            offset += grad.numel()
        sent, where = gather(torch.cat(values), torch.cat(indices), groups)
        total = grads[0].new_zeros(offset)
        scatter_rows(sent, where, total)
        return list(total.split([g.numel() for g in grads]))

    def _block_topk(
        self, grads: list[torch.Tensor], groups: list[AxisGroup], states: list[_State]
    ) -> list[torch.Tensor]:
        """As ``_topk``, in blocks: indices number blocks of the bucket, each tensor's
        blocks padded apart."""
        block = self.scheme.block
        values, indices, first = [], [], 0
        for grad, state in zip(grads, states, strict=True):
            residual = self._accumulate(grad, state)
            chosen = select_blocks(residual, block, self.scheme.kept(grad.numel()))
            padded = pad_to_blocks(residual, block)
            values.append(padded[chosen].reshape(-1))
            indices.append((chosen + first).to(torch.int32))
            padded[chosen] = 0.0
            residual.copy_(padded.view(-1)[: residual.numel()])
            first += padded.shape[0]
        sent, where = gather(torch.cat(values), torch.cat(indices), groups)
        total = scatter_rows(
            sent.view(where.shape[0], where.shape[1], block),
            where,
            grads[0].new_zeros(first, block),
        )
        out, start = [], 0
        for grad in grads:
            blocks = math.ceil(grad.numel() / block)
            out.append(total[start : start + blocks].reshape(-1)[: grad.numel()])
            start += blocks
        return out

    def _accumulate(self, grad: torch.Tensor, state: _State) -> torch.Tensor:
        """Error feedback: ``v += g``, or with DGC's momentum correction ``u = m u + g;
        v += u``. Returns ``v`` (the state itself)."""
        residual = state.residual
        assert residual is not None
        flat = grad.reshape(-1)
        if state.velocity is not None:
            state.velocity.mul_(self.scheme.momentum).add_(flat)
            flat = state.velocity
        return residual.add_(flat)

    # powersgd ------------------------------------------------------------------------

    def _powersgd(
        self, grads: list[torch.Tensor], groups: list[AxisGroup], states: list[_State]
    ) -> list[torch.Tensor]:
        """P = M Q (all-reduce, each axis), orthonormalise, Q = M^T P (all-reduce, each
        axis), the sum P Q^T; each device keeps M - P (its own M^T P)^T."""
        rank = self.scheme.rank
        ms, qs = [], []
        for grad, state in zip(grads, states, strict=True):
            assert state.residual is not None and state.q is not None
            shape = matrix_shape(grad.shape)
            ms.append(state.residual.view(shape).add_(grad.reshape(shape)))  # M = G + e
            qs.append(state.q)
        p_flat = torch.cat([(m @ q).reshape(-1) for m, q in zip(ms, qs, strict=True)])
        for group in groups:
            group.all_reduce(p_flat)
        ps = [
            orthonormalize(p.view(m.shape[0], rank))
            for p, m in zip(p_flat.split([m.shape[0] * rank for m in ms]), ms, strict=True)
        ]
        q_local = torch.cat([(m.T @ p).reshape(-1) for m, p in zip(ms, ps, strict=True)])
        q_flat = q_local.clone()
        for group in groups:
            group.all_reduce(q_flat)
        sizes = [m.shape[1] * rank for m in ms]
        q_sums = [q.view(-1, rank) for q in q_flat.split(sizes)]
        q_owns = [q.view(-1, rank) for q in q_local.split(sizes)]
        for m, p, q_own, q_sum, state in zip(ms, ps, q_owns, q_sums, states, strict=True):
            m.sub_(p @ q_own.T)  # e = M - P (M^T P)^T: the residual state, in place
            state.q = q_sum.clone()  # the warm start
        return [p @ q.T for p, q in zip(ps, q_sums, strict=True)]


def gather(
    values: torch.Tensor, indices: torch.Tensor, groups: Sequence[AxisGroup]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every device's ``values`` and ``indices`` (1-D), as rows ``[devices, ...]``: gathered
    over each axis in turn, each axis gathering what the previous ones collected."""
    kept = indices.numel()
    for group in groups:
        values = all_gather_rows(values, group).reshape(-1)
        indices = all_gather_rows(indices, group).reshape(-1)
    indices = indices.view(-1, kept)
    return values.view(indices.shape[0], -1), indices
