"""CPU offload's runtime pieces on a CPU-only machine (``runtime.offload``, issue 25).

Host and device are one memory here, but the code path is the GPU's: every offload is a
real, separate copy, so the tests hold its values, its byte counts and what it frees to
what autograd does without it. Saved bytes are measured independently of the module's rule:
a plain ``saved_tensors_hooks`` pair counts the distinct storages autograd saves that are
not parameters' storages.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from autopar.runtime.offload import (
    ActivationOffload,
    HostLog,
    device_copy,
    host_copy,
    offloaded_bytes,
    offloads,
)
from autopar.runtime.regather import ParamGathers

CPU = torch.device("cpu")
Loss = Callable[[nn.Module], torch.Tensor]


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 24), nn.Tanh())
    return model, torch.randn(6, 12)


def _block() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return layer, torch.randn(2, 5, 16)


class _Checkpointed(nn.Module):
    """Three layers, the middle one a non-reentrant activation checkpoint."""

    def __init__(self, recompute: bool = True) -> None:
        super().__init__()
        self.recompute = recompute
        self.first = nn.Linear(8, 16)
        self.middle = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.last = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = checkpoint(self.middle, h, use_reentrant=False) if self.recompute else self.middle(h)
        return torch.tanh(self.last(h))


def _checkpointed() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Checkpointed(), torch.randn(4, 8)


MODELS = {"mlp": _mlp, "transformer_block": _block, "checkpointed": _checkpointed}


def _saved(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor autograd saves in ``model(x)``, as a plain hook pair sees them."""
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return saved


def _unique_activation_bytes(model: nn.Module, saved: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages in ``saved`` that hold no parameter."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for left, right in zip(a, b, strict=True):
        assert torch.equal(left, right)


# --- HostLog, host_copy, device_copy --------------------------------------------------------


def test_host_log_counts_copies_and_bytes_per_direction_and_purpose() -> None:
    log = HostLog()
    log.record("to_host", "optimizer", 100)
    log.record("to_host", "activations", 40)
    log.record("to_host", "activations", 2)
    log.record("to_device", "params", 8)
    assert log.totals() == {"to_host": 142, "to_device": 8}
    assert log.totals("activations") == {"to_host": 42, "to_device": 0}
    assert log.count("to_host") == 3
    assert log.count("to_host", "activations") == 2
    assert log.copies[("to_device", "params")] == 1
    with pytest.raises(ValueError, match="direction"):
        log.record("sideways", "params", 1)  # type: ignore[arg-type]
    copied = copy.deepcopy(log)  # a model holding its log can be copied
    copied.record("to_device", "params", 1)
    assert (copied.totals()["to_device"], log.totals()["to_device"]) == (9, 8)
    log.reset()
    assert log.totals() == {"to_host": 0, "to_device": 0}
    assert log.count("to_device") == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_host_and_device_copies_round_trip_values_dtypes_and_bytes(dtype: torch.dtype) -> None:
    source = (torch.arange(24) * 3 - 7).reshape(4, 6).to(dtype).t()  # not contiguous
    log = HostLog()
    down = host_copy(source, CPU, log, "optimizer").wait()
    up = device_copy(down, CPU, log, "optimizer").wait()
    for copied in (down, up):
        assert copied.dtype == dtype
        assert copied.stride() == source.stride()
        assert torch.equal(copied, source)
    # separate memory: a copy really happened, though host and device are one here
    pointers = {t.untyped_storage().data_ptr() for t in (source, down, up)}
    assert len(pointers) == 3
    nbytes = source.numel() * source.element_size()
    assert log.totals("optimizer") == {"to_host": nbytes, "to_device": nbytes}
    assert log.count("to_host") == log.count("to_device") == 1


def test_copies_detach_and_fill_a_given_buffer() -> None:
    param = nn.Parameter(torch.randn(3, 5))
    log = HostLog()
    buffer = torch.zeros(3, 5)
    down = host_copy(param, CPU, log, "params", out=buffer).wait()
    assert down is buffer
    assert not down.requires_grad
    assert torch.equal(down, param.detach())
    target = torch.empty(3, 5)
    assert device_copy(down * 2, CPU, log, "params", out=target).wait() is target
    assert torch.equal(target, param.detach() * 2)
    with pytest.raises(ValueError, match="float64"):
        device_copy(down.double(), CPU, log, "params", out=target)
    assert log.count("to_host") == log.count("to_device") == 1


# --- which saved tensors move -----------------------------------------------------------------


def test_offloads_activations_but_not_parameters_or_leaves() -> None:
    weight = nn.Parameter(torch.randn(4, 4))
    leaf = torch.randn(4, requires_grad=True)
    activation = weight @ torch.randn(4, 4)
    assert offloads(activation, CPU)
    assert offloads(torch.randn(4), CPU)  # no grad, but no one else holds it either
    assert offloads(activation[1:], CPU)
    assert not offloads(weight, CPU)
    assert not offloads(weight.t(), CPU)  # what addmm saves of a Linear's weight
    assert not offloads(leaf, CPU)
    assert not offloads(leaf[:2], CPU)
    assert offloads(torch.arange(4), CPU)  # indices and masks are activations too
    assert offloads(torch.zeros(4, dtype=torch.bool), CPU)
    assert not offloads(torch.empty(0), CPU)
    assert not offloads(torch.randn(4), torch.device("meta"))  # not on the device
    assert not offloads(torch.randn(4), CPU, min_bytes=17)
    assert offloads(torch.randn(4), CPU, min_bytes=16)
    # a storage counts once, whole, however many views of it are saved
    assert offloaded_bytes([activation, activation[1:], activation.t(), weight], CPU) == 64


# --- saved activations --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_offloaded_training_is_bit_identical_and_counts_the_saved_bytes(name: str) -> None:
    model, x = MODELS[name]()
    reference = copy.deepcopy(model)
    expected_out = reference(x)
    expected_out.square().sum().backward()
    saved = _saved(reference, x)
    expected_bytes = _unique_activation_bytes(reference, saved)
    assert expected_bytes > 0
    assert offloaded_bytes(saved, CPU) == expected_bytes

    offload = ActivationOffload(CPU)
    with offload:
        out = model(x)
    assert offload.log.totals() == {"to_host": expected_bytes, "to_device": 0}
    assert offload.held_on_host() == expected_bytes
    out.square().sum().backward()
    assert offload.log.totals("activations") == {
        "to_host": expected_bytes,
        "to_device": expected_bytes,
    }
    assert offload.log.count("to_host") == offload.log.count("to_device")
    assert offload.held_on_host() == 0
    assert torch.equal(out, expected_out)
    _assert_identical(_grads(model), _grads(reference))


def test_device_side_saved_tensors_are_freed_after_forward() -> None:
    model, x = _mlp()
    produced: list[StorageWeakRef] = []
    for layer in model:
        layer.register_forward_hook(
            lambda _m, _a, out: produced.append(StorageWeakRef(out.untyped_storage()))
        )
    saved_later = slice(0, 2)  # the first Linear's and the GELU's outputs, saved by the next op
    plain = model(x)
    assert not any(ref.expired() for ref in produced[saved_later])  # kept for backward
    del plain
    produced.clear()
    offload = ActivationOffload(CPU)
    with offload:
        out = model(x)
    assert all(ref.expired() for ref in produced[saved_later])  # only host copies remain
    assert not produced[-1].expired()  # the output, which the caller holds
    assert offload.held_on_host() > 0
    out.sum().backward()


def _shared_saves(weight: torch.Tensor) -> torch.Tensor:
    """A loss whose ops save one activation ``h`` four times: twice by a multiply, and as
    two different views of it."""
    h = torch.arange(36.0).reshape(6, 6).sin() @ weight
    return (h * h).sum() + (h[2:].t() @ weight[2:]).sum() + h.t().sin().sum()


def test_a_storage_saved_twice_or_through_views_is_copied_once() -> None:
    reference = nn.Parameter(torch.randn(6, 6))
    weight = nn.Parameter(reference.detach().clone())
    _shared_saves(reference).backward()
    offload = ActivationOffload(CPU)
    with offload:
        out = _shared_saves(weight)
    assert offload.log.count("to_host") == 2  # h, and the sine's output (the matmul's input)
    assert offload.held_on_host() == 2 * 36 * 4
    out.backward()
    assert offload.log.count("to_device") == 2
    assert offload.held_on_host() == 0
    assert torch.equal(weight.grad, reference.grad)


def test_a_storage_written_in_place_between_saves_is_copied_again() -> None:
    offload = ActivationOffload(CPU)
    with offload:
        h = torch.randn(5) * torch.randn(5, requires_grad=True)
        h.sin()  # saves h at version 0
        with torch.no_grad():
            h.add_(1.0)
        h.cos()  # saves h at version 1: the first copy is stale for it
    assert offload.log.count("to_host") == 1 + 2  # the multiply's right operand too


def test_forwards_before_a_backward_add_up_on_the_host() -> None:
    model, x = _mlp()
    offload = ActivationOffload(CPU)
    outs = []
    for micro in x.chunk(2):
        with offload:
            outs.append(model(micro))
    one = offload.log.totals()["to_host"] // 2
    assert offload.held_on_host() == 2 * one > 0
    outs.pop().sum().backward()
    assert offload.held_on_host() == one
    outs.pop().sum().backward()
    assert offload.held_on_host() == 0


def test_a_retained_graph_brings_its_activations_back_for_each_backward() -> None:
    model, x = _mlp()
    reference = copy.deepcopy(model)
    for _ in range(2):
        reference(x).sum().backward()
    offload = ActivationOffload(CPU)
    with offload:
        out = model(x).sum()
    out.backward(retain_graph=True)
    out.backward()
    totals = offload.log.totals()
    assert totals["to_device"] == 2 * totals["to_host"]
    _assert_identical(_grads(model), _grads(reference))


def test_keep_leaves_tensors_the_caller_holds_on_the_device() -> None:
    model, x = _mlp()
    kept = x.untyped_storage().data_ptr()
    everything = ActivationOffload(CPU)
    with everything:
        out = model(x)
    offload = ActivationOffload(CPU, keep=lambda t: t.untyped_storage().data_ptr() == kept)
    with offload:
        kept_out = model(x)
    input_bytes = x.numel() * x.element_size()
    assert offload.held_on_host() == everything.held_on_host() - input_bytes > 0
    (out + kept_out).sum().backward()
    assert offload.held_on_host() == everything.held_on_host() == 0


def test_tensors_not_offloaded_go_to_the_hooks_outside() -> None:
    model, x = _mlp()
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    seen: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tensor)
        return tensor

    offload = ActivationOffload(CPU)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), offload:
        out = model(x)
    assert seen  # the Linear weights, which stay on the device
    assert not any(offloads(t, CPU) for t in seen)
    assert offload.held_on_host() > 0
    out.sum().backward()
    _assert_identical(_grads(model), _grads(reference))


def test_a_checkpointed_region_is_recomputed_not_offloaded() -> None:
    offloaded = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model, x = _Checkpointed(recompute), torch.randn(4, 8)
        offload = ActivationOffload(CPU)
        with offload:
            out = model(x)
        held = offloaded[recompute] = offload.held_on_host()
        out.sum().backward()
        # backward's recomputation packs with the checkpoint's own hooks, not these
        assert offload.log.totals() == {"to_host": held, "to_device": held}
    region = 4 * 16 * 4  # what the middle saves of its own: the GELU's input and output
    assert offloaded[False] - offloaded[True] == 2 * region


def test_inner_hooks_that_hand_tensors_out_reach_the_offload() -> None:
    """``runtime.regather``'s pair, entered inside the offload by the compiled model's
    forward, passes every tensor that is not a gathered weight out to it."""
    model, x = _mlp()
    plain = ActivationOffload(CPU)
    with plain:
        model(x).sum().backward()
    offload = ActivationOffload(CPU)
    with offload, ParamGathers(lambda _t: False).hooks():
        out = model(x)
    assert offload.held_on_host() == plain.log.totals()["to_host"] > 0
    out.sum().backward()
    assert offload.log.totals() == plain.log.totals()


def test_an_offload_is_entered_once_at_a_time() -> None:
    offload = ActivationOffload(CPU)
    with offload, pytest.raises(RuntimeError, match="already entered"), offload:
        pass
    with offload:  # and again after it exits
        pass
