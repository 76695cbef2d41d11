"""A sum in flight (``runtime.pending``): every read waits for it; backward does not."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch

from autopar.runtime.pending import PendingSum


class _Work:
    """A collective that completes when waited for: it writes the sum into the buffer
    then, so a reader that did not wait would see the partial value."""

    def __init__(self, buffer: torch.Tensor, total: torch.Tensor) -> None:
        self.buffer, self.total, self.waits = buffer, total, 0

    def wait(self) -> bool:
        self.waits += 1
        self.buffer.copy_(self.total)
        return True


def _saved_and_loaded(t: torch.Tensor) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _pending(partial: float = 1.5, total: float = 6.0) -> tuple[PendingSum, _Work]:
    buffer = torch.tensor(partial)
    work = _Work(buffer, torch.tensor(total))
    return PendingSum(buffer, work), work


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.item(),
        lambda t: float(t.detach()),
        lambda t: float(t * 1),
        lambda t: float(t + 0),
        lambda t: float(t.clone()),
        lambda t: float(repr(t).removeprefix("tensor(").removesuffix(")")),
        lambda t: float(f"{t:.1f}"),
        lambda t: float(t.numpy()),
        lambda t: float(np.asarray(t)),
        lambda t: t.tolist(),
        lambda t: float(t.cpu()),
        lambda t: float(torch.stack([t, t])[0]),
        lambda t: float(pickle.loads(pickle.dumps(t))),
        lambda t: float(_saved_and_loaded(t)),
        lambda t: float(copy.deepcopy(t)),
    ],
    ids=[
        "item",
        "detach",
        "mul",
        "add",
        "clone",
        "repr",
        "format",
        "numpy",
        "asarray",
        "tolist",
        "cpu",
        "stack",
        "pickle",
        "torch.save",
        "deepcopy",
    ],
)
def test_every_read_gives_the_sum(read) -> None:
    pending, work = _pending()
    assert pending.in_flight
    assert read(pending) == 6.0
    assert not pending.in_flight and work.waits == 1


def test_it_waits_once() -> None:
    pending, work = _pending()
    assert pending.item() == pending.item() == 6.0
    assert work.waits == 1


def test_its_shape_and_a_gradient_of_ones_need_no_wait() -> None:
    pending, work = _pending()
    assert (pending.shape, pending.dtype) == (torch.Size([]), torch.float32)
    ones = torch.ones_like(pending)
    assert type(ones) is torch.Tensor and float(ones) == 1.0
    assert pending.in_flight and work.waits == 0


def test_a_value_read_in_the_graph_of_a_later_op_is_the_sum() -> None:
    """An op on the pending loss (a scaled loss, say) has the sum in its value, and its
    gradient flows back through it."""
    weight = torch.tensor(2.0, requires_grad=True)
    pending, _ = _pending()
    scaled = pending * weight
    scaled.backward()
    assert float(scaled.detach()) == 12.0
    assert float(weight.grad) == 6.0
