"""Moving tensors between a device and host memory: the runtime half of CPU offload.

Three pieces, used by the compiled model (optimizer state, master weights, parameters and
saved activations, issue 25):

- ``HostLog``: how many copies and bytes crossed the host link, per direction and purpose,
  so that tests can hold the run to the plan's figures.
- ``host_copy`` / ``device_copy``: one tensor down to host memory or back up, returned as a
  ``Transfer`` whose ``wait()`` says when the copy may be read.
- ``ActivationOffload``: a ``saved_tensors_hooks`` context that keeps what autograd saves in
  forward in host memory until backward needs it (``torch.autograd.graph.save_on_cpu``'s
  idea, with pinned buffers, a side stream, one copy per storage and a byte count).

On CUDA a copy to the host goes into pinned memory, non-blocking, on a given side stream
(``ActivationOffload`` keeps one) that first waits for the compute stream, and records an
event that the consumer waits on; the source is marked used by the side stream
(``record_stream``) so that the caching allocator does not hand its memory to the next op
while the copy still reads it. On a CPU-only
machine host and device are the same memory, but the same code path runs: every copy is a
real, separate copy (so it happens, costs and is counted as on a GPU), only without pinning,
streams or events. That is what lets the offload be tested for correctness on CPU.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

Direction = Literal["to_host", "to_device"]
DIRECTIONS: tuple[Direction, ...] = ("to_host", "to_device")
HOST = torch.device("cpu")


@dataclass
class HostLog:
    """Copies and bytes that crossed the host link, per (direction, purpose).

    ``direction`` is ``"to_host"`` or ``"to_device"``; ``purpose`` names what moved
    (``"activations"``, ``"optimizer"``, ``"params"``, ...). Bytes are those copied: the
    copy's numel times its element size. Safe to share between threads (backward may
    unpack saved tensors on autograd's device threads).
    """

    copies: dict[tuple[Direction, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[Direction, str], int] = field(default_factory=dict)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles carry the counts, not the lock (which cannot be copied)."""
        return {"copies": dict(self.copies), "nbytes": dict(self.nbytes)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.copies = state["copies"]
        self.nbytes = state["nbytes"]
        self._lock = threading.Lock()

    def record(self, direction: Direction, purpose: str, nbytes: int) -> None:
        """One copy of ``nbytes`` bytes went ``direction`` for ``purpose``."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
        if nbytes < 0:
            raise ValueError(f"a copy moves a non-negative number of bytes, not {nbytes}")
        key = (direction, purpose)
        with self._lock:
            self.copies[key] = self.copies.get(key, 0) + 1
            self.nbytes[key] = self.nbytes.get(key, 0) + nbytes

    def totals(self, purpose: str | None = None) -> dict[Direction, int]:
        """Bytes per direction, over every purpose or only ``purpose``; both directions are
        always present (0 when nothing moved that way)."""
        with self._lock:
            items = list(self.nbytes.items())
        out: dict[Direction, int] = dict.fromkeys(DIRECTIONS, 0)
        for (direction, what), count in items:
            if purpose is None or what == purpose:
                out[direction] += count
        return out

    def count(self, direction: Direction, purpose: str | None = None) -> int:
        """How many copies went ``direction`` (for ``purpose``, or for any)."""
        with self._lock:
            items = list(self.copies.items())
        return sum(n for (way, what), n in items if way == direction and purpose in (None, what))

    def reset(self) -> None:
        """Forget every copy (between the steps a test measures)."""
        with self._lock:
            self.copies.clear()
            self.nbytes.clear()


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class Transfer:
    """A copy that was issued: ``tensor`` is the destination, readable after ``wait()``.

    ``event`` is None when no CUDA tensor took part (the copy has already happened);
    otherwise it was recorded on the copying stream right after the copy.
    """

    tensor: torch.Tensor
    event: torch.cuda.Event | None = None

    def wait(self) -> torch.Tensor:
        """Make the copy safe to read, and return it: a host destination blocks the CPU
        until the copy is done (a CPU optimizer step is about to read it); a device
        destination makes the current stream wait (the device's next op reads it), so the
        CPU does not block."""
        if self.event is None:
            return self.tensor
        if self.tensor.device.type == "cpu":
            self.event.synchronize()
        else:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
        return self.tensor


def _check_out(out: torch.Tensor, source: torch.Tensor, device: torch.device) -> None:
    """A reused destination must match the source exactly: a silent cast or resize would
    change both the values and the bytes the log counts."""
    if out.shape != source.shape or out.dtype != source.dtype:
        raise ValueError(
            f"out is {out.dtype}{list(out.shape)}, the source {source.dtype}{list(source.shape)}"
        )
    if out.device.type != device.type:
        raise ValueError(f"out is on {out.device}, the copy goes to {device}")


def _issue(
    source: torch.Tensor, out: torch.Tensor, stream: torch.cuda.Stream | None
) -> torch.cuda.Event | None:
    """Copy ``source`` into ``out``. Where either is on CUDA, the copy runs on ``stream``
    (the current stream when None) after the current stream's work so far (which made
    ``source`` and last used ``out``), non-blocking, and an event recorded after it is
    returned; otherwise it is a plain synchronous copy and None is returned."""
    cuda = next((t.device for t in (source, out) if _is_cuda(t.device)), None)
    with torch.no_grad():
        if cuda is None:
            out.copy_(source)
            return None
        current = torch.cuda.current_stream(cuda)
        stream = current if stream is None else stream
        if stream != current:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            out.copy_(source, non_blocking=True)
        if stream != current:
            # the caching allocator would otherwise hand either block to the current
            # stream's next allocation while the side stream still reads or writes it
            for tensor in (source, out):
                if tensor.is_cuda:
                    tensor.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event


def host_copy(
    tensor: torch.Tensor,
    host_device: torch.device,
    log: HostLog,
    purpose: str,
    *,
    pin: bool = True,
    out: torch.Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
) -> Transfer:
    """Copy ``tensor`` (detached) to ``host_device``, count it in ``log`` under
    ``purpose``, and return the issued copy (its ``wait()`` gives the host tensor).

    From a CUDA tensor: into pinned memory when ``pin`` (so the copy is truly
    non-blocking), on ``stream`` (pass a side stream to overlap compute; None: the current
    stream), with an event in the result. From a tensor already in host memory (a CPU-only
    machine): a plain synchronous copy, still a separate tensor. A dense tensor keeps its
    strides. ``out``: a host buffer to fill instead (a persistent pinned buffer) of
    ``tensor``'s shape and dtype.
    """
    if out is None:
        pinned = pin and _is_cuda(tensor.device)
        out = torch.empty_like(tensor, device=host_device, pin_memory=pinned)
    else:
        _check_out(out, tensor, host_device)
    event = _issue(tensor, out, stream)
    log.record("to_host", purpose, _nbytes(out))
    return Transfer(out, event)


def device_copy(
    host_tensor: torch.Tensor,
    device: torch.device,
    log: HostLog,
    purpose: str,
    out: torch.Tensor | None = None,
    *,
    stream: torch.cuda.Stream | None = None,
) -> Transfer:
    """Copy ``host_tensor`` (detached) up to ``device``, count it in ``log`` under
    ``purpose``, and return the issued copy (its ``wait()`` gives the device tensor).

    To CUDA: the destination is allocated on the current stream (which will read it) and
    filled on ``stream`` (a side stream to prefetch; None: the current stream),
    non-blocking from pinned memory; ``wait()`` orders the current stream after it. To
    the host device itself (CPU-only): a plain synchronous copy. ``out``: a device buffer
    to refill in place (a parameter's storage) of the host tensor's shape and dtype.
    """
    if out is None:
        out = torch.empty_like(host_tensor, device=device)
    else:
        _check_out(out, host_tensor, device)
    event = _issue(host_tensor, out, stream)
    log.record("to_device", purpose, _nbytes(out))
    return Transfer(out, event)


# --- saved activations -------------------------------------------------------------------


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a view was taken of (autograd hands out ``weight.t()``, not ``weight``)."""
    base = tensor._base
    return base if base is not None else tensor


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` lives on ``device`` (``cuda`` without an index matches any)."""
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage ``tensor`` views: what autograd keeps alive by saving it, and
    what the offload copies (once per storage)."""
    return tensor.untyped_storage().nbytes()


def offloads(tensor: torch.Tensor, device: torch.device, *, min_bytes: int = 0) -> bool:
    """Whether ``ActivationOffload`` moves this saved tensor to the host (the rule the
    plan's estimate must use too).

    Offloaded: a plain strided tensor of any dtype (integer indices and bool masks are
    activations the plan counts too) on ``device`` with ``numel > 0``, whose storage holds
    at least ``min_bytes``, that is not a parameter or a leaf that requires grad, nor a
    view of one (its ``_base``): those live on the device anyway, so copying them would
    cost the link and free nothing. Everything else (tensors already on another device,
    subclasses, sparse, conj/neg views) stays where it is. Two saved tensors of one storage
    are one offload of the whole storage.
    """
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return False
    if tensor.numel() == 0:
        return False
    if tensor.is_conj() or tensor.is_neg() or not _on(tensor, device):
        return False
    root = _root(tensor)
    if isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad):
        return False
    return storage_bytes(tensor) >= min_bytes


def offloaded_bytes(
    saved: Iterable[torch.Tensor], device: torch.device, *, min_bytes: int = 0
) -> int:
    """Bytes ``ActivationOffload`` copies to the host for one forward that saves ``saved``
    (each distinct storage that ``offloads`` accepts, counted once); pure, so an estimate
    or a test can hold the runtime to it."""
    seen: dict[int, int] = {}
    for tensor in saved:
        if offloads(tensor, device, min_bytes=min_bytes):
            seen[tensor.untyped_storage()._cdata] = storage_bytes(tensor)
    return sum(seen.values())


class _Stored:
    """One device storage's bytes in host memory, shared by every saved tensor of it.

    ``packs`` handles point here; backward brings the bytes up once and hands the device
    copy to each handle it unpacks, dropping it after the last (``left``), so a storage
    saved by two ops crosses the link once each way.
    """

    def __init__(
        self, host: torch.Tensor, device: torch.device, ready: torch.cuda.Event | None
    ) -> None:
        self.host = host
        self.device = device  # where the storage lived, and goes back to
        self.ready = ready
        self.packs = 0
        self.left = 0
        self.on_device: torch.Tensor | None = None
        self.lock = threading.Lock()


@dataclass(frozen=True)
class _Handle:
    """What autograd holds for an offloaded tensor: the stored storage and the view."""

    stored: _Stored
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, stored: _Stored, tensor: torch.Tensor) -> _Handle:
        """A handle rebuilding ``tensor``'s view of its storage from ``stored``."""
        size, stride = tuple(tensor.size()), tuple(tensor.stride())
        return cls(stored, tensor.dtype, size, stride, tensor.storage_offset())


@dataclass(frozen=True)
class _Outer:
    """A tensor not offloaded, packed by the hooks active outside ours."""

    value: Any
    unpack: Callable[[Any], torch.Tensor]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over ``tensor``'s whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class ActivationOffload:
    """Keep the tensors autograd saves in forward in host memory until backward.

    Enter it around a forward (each forward of a step may enter it again): each saved
    tensor that ``offloads`` accepts (and ``keep`` does not) is copied, storage and all,
    to ``host`` once per storage and version (two ops saving one tensor, or views of one
    tensor, share the copy) and the device tensor is not kept, so its memory is freed as
    soon as forward drops it. Backward copies a storage back on its first unpack and
    shares it with the storage's other saved tensors. Bytes go to ``log`` under
    ``"activations"``; ``held_on_host()`` is what the host holds now.

    - ``device``: the compute device whose tensors move (``cpu`` on a CPU-only machine,
      where host and device are one memory but the copies still happen; ``cuda`` without
      an index: any GPU's). Each storage comes back to the device it left.
    - ``keep``: tensors the caller holds on the device anyway (the model's inputs and
      buffers, parameter shards that are not leaves), left in place like parameters.
    - ``min_bytes``: storages smaller than this stay on the device (the copy's latency
      outweighs what it frees).

    On CUDA, pack records the compute stream's progress on a side stream and copies into
    pinned memory there, so the copy overlaps the rest of forward; unpack makes the
    current stream wait for that copy and copies back synchronously on the current stream
    (stream-ordered, not prefetched: backward's first use of a storage waits for it).

    Other ``saved_tensors_hooks``: tensors not offloaded go to the pair active outside this
    one (a memory probe sees what stays on the device). Inside it, a pair entered later
    wins: a non-reentrant ``torch.utils.checkpoint`` region packs its tensors with its
    own hooks (they are recomputed in backward, not offloaded; only the region's inputs,
    which the checkpoint itself holds, stay on the device), and ``runtime.regather``'s
    hooks hand every tensor but gathered weights back out to this one. Do not enter an
    offload *inside* a checkpointed function: its pair would shadow the checkpoint's, so
    the region's tensors are offloaded instead of dropped, and backward's recomputation
    offloads them again (gradients stay right; the checkpoint saves nothing).
    """

    def __init__(
        self,
        device: torch.device,
        log: HostLog | None = None,
        *,
        host: torch.device = HOST,
        min_bytes: int = 0,
        keep: Callable[[torch.Tensor], bool] | None = None,
        pin: bool = True,
    ) -> None:
        self.device = device
        self.host = host
        self.log = log if log is not None else HostLog()
        self.min_bytes = min_bytes
        self._keep = keep
        self._pin = pin
        self._stored: weakref.WeakSet[_Stored] = weakref.WeakSet()
        # this forward's copies by (storage, version): cleared on exit, and weak in the
        # storage so a freed activation's memory reused by another is not mistaken for it
        self._this_forward: dict[tuple[StorageWeakRef, int], _Stored] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._stream: torch.cuda.Stream | None = None
        self._outer: tuple[Callable[..., Any], Callable[..., Any]] | None = None

    def offloads(self, tensor: torch.Tensor) -> bool:
        """Whether this offload moves ``tensor`` when autograd saves it."""
        if self._keep is not None and self._keep(tensor):
            return False
        return offloads(tensor, self.device, min_bytes=self.min_bytes)

    def held_on_host(self) -> int:
        """Bytes of host memory that saved tensors occupy now (from every forward whose
        graph is alive: 0 once backward has released them)."""
        return sum(_nbytes(stored.host) for stored in list(self._stored))

    def __enter__(self) -> ActivationOffload:
        if self._hooks is not None:
            raise RuntimeError("this ActivationOffload is already entered")
        # private, but how torch itself reads the active pair (aot_autograd, regather)
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._stream = torch.cuda.Stream(device=self.device) if _is_cuda(self.device) else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        hooks, self._hooks = self._hooks, None
        self._this_forward.clear()
        self._outer = None
        if hooks is not None:
            hooks.__exit__(exc_type, exc, traceback)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self.offloads(tensor):
            if self._outer is None:
                return tensor
            pack, unpack = self._outer
            return _Outer(pack(tensor), unpack)
        key = (StorageWeakRef(tensor.untyped_storage()), tensor._version)
        stored = self._this_forward.get(key)
        if stored is None:
            stored = self._store(tensor)
            self._this_forward[key] = stored
        stored.packs += 1
        return _Handle.of(stored, tensor)

    def _store(self, tensor: torch.Tensor) -> _Stored:
        copy = host_copy(
            _bytes_of(tensor),
            self.host,
            self.log,
            "activations",
            pin=self._pin,
            stream=self._stream,
        )
        stored = _Stored(copy.tensor, tensor.device, copy.event)
        self._stored.add(stored)
        return stored

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Outer):
            return packed.unpack(packed.value)
        if not isinstance(packed, _Handle):
            return packed  # a tensor kept on the device, with no hooks outside ours
        whole = self._bring_back(packed.stored)
        view = torch.empty(0, dtype=packed.dtype, device=whole.device)
        return view.set_(whole.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _bring_back(self, stored: _Stored) -> torch.Tensor:
        """The storage's bytes on the device: copied up on the first unpack, shared until
        every saved tensor of it has been unpacked (then dropped, so it is freed when the
        last user is done; a second backward over a retained graph copies again)."""
        with stored.lock:
            whole = stored.on_device
            if whole is None:
                if stored.ready is not None:
                    torch.cuda.current_stream(stored.device).wait_event(stored.ready)
                whole = device_copy(stored.host, stored.device, self.log, "activations").tensor
                stored.left = stored.packs
            stored.left -= 1
            stored.on_device = whole if stored.left > 0 else None
            return whole


def install_activation_offload(
    program: torch.nn.Module, device: torch.device, log: HostLog
) -> ActivationOffload:
    """Offload what ``program`` (a rank's program or pipeline stage) saves in each of its
    forward calls, as ``plan.offload.activations`` asks: entered before and left after any
    other pair its hooks enter (``runtime.regather``'s, which must see gathered weights
    first), keeping its buffers and constants on the device (the plan's saved bytes count
    neither)."""
    held = {t.untyped_storage().data_ptr() for t in [*program.buffers(), *_constants(program)]}
    offload = ActivationOffload(device, log, keep=lambda t: t.untyped_storage().data_ptr() in held)

    def enter(_module: torch.nn.Module, _args: Any) -> None:
        offload.__enter__()

    def leave(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        offload.__exit__(None, None, None)

    program.register_forward_pre_hook(enter, prepend=True)
    program.register_forward_hook(leave, always_call=True)
    return offload


def _constants(program: torch.nn.Module) -> list[torch.Tensor]:
    """Plain tensors a program holds as attributes (``get_attr`` constants)."""
    return [
        value
        for module in program.modules()
        for value in vars(module).values()
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
    ]
