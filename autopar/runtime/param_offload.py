"""Parameter offload (ZeRO-Infinity's ``offload_param``): working copies in host memory,
each layer's copied up as the program reaches it, the next one prefetched.

Under an offloaded optimizer (``runtime.zero``) the device still holds every parameter's
working copy for the whole step. With the parameters offloaded too (``Offload.parameters``,
Rajbhandari et al. 2021, arXiv 2104.07857) it holds none between uses:

- The tensor the graph's ``get_attr`` reads stays a device leaf, so that autograd
  accumulates the working gradient into it as before (ZeRO's buckets sum it and copy it
  down), but it owns no memory (its storage resized to nothing, as FSDP frees unsharded
  parameters) and nothing reads its values.
- ``fetch_params`` rewrites a program: the reads of one layer's offloaded parameters become
  one ``FetchParams`` call, placed before the first of their uses, that copies each
  parameter's host copy up (``runtime.offload.device_copy``, counted in the ``HostLog``
  under ``"parameters"``) and whose outputs the graph computes on; its backward hands the
  gradients to the leaves. A parameter is fetched once per forward, in the group of its
  first read (a tied embedding's copy serves the head too). A recompute region's reads are
  fetched inside the region, so that its recomputation in backward fetches them again
  rather than the checkpoint keeping the fetched copies.
- **Prefetch**, one layer ahead as ZeRO-Infinity and FSDP2 do: a fetch launches the next
  group's copies without waiting (on a side stream on CUDA), so they run while this layer
  computes.
- **Backward**: an op that saves a fetched weight (or a view or gather of it) does not keep
  it. The regather hooks (``runtime.regather``) pack it as a recipe whose source is its
  group's ``Refetch``: the first unpack in backward copies the group's saved members up
  once, prefetching the group backward reaches next, and the last unpack drops them.

So a step copies every parameter's working copy up once per microbatch in forward, and the
saved ones once more in backward; the plan's ``Estimate.host`` counts the same copies
(``autopar_passes.offload_ledger.parameter_copies``).
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autopar.runtime.offload import HostLog, Transfer, device_copy
from autopar.runtime.param_groups import GatherParams
from autopar.runtime.regather import BackwardOrder
from autopar_passes.lower_recompute import Recompute, free_name

PURPOSE = "parameters"
HostPiece = Callable[[], torch.Tensor]  # a parameter's working copy in host memory, now


@dataclass(frozen=True)
class Uplink:
    """Where fetched parameters go, what counts their copies, and the stream that copies
    them ahead of use (CUDA; None on a CPU-only machine, where copies are synchronous)."""

    device: torch.device
    log: HostLog
    stream: torch.cuda.Stream | None = None

    @classmethod
    def to(cls, device: torch.device, log: HostLog) -> Uplink:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        return cls(device, log, stream)

    def copy_up(self, pieces: Sequence[HostPiece], ahead: bool) -> list[Transfer]:
        """Each piece copied up; on the side stream when ``ahead`` (a prefetch)."""
        stream = self.stream if ahead else None
        return [
            device_copy(piece(), self.device, self.log, PURPOSE, stream=stream) for piece in pieces
        ]


def storageless_leaf(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A leaf of ``like``'s shape and dtype on ``device`` that owns no memory: what the
    graph reads for an offloaded parameter (its values are fetched, its gradient kept)."""
    leaf = torch.empty(like.shape, dtype=like.dtype, device=device)
    leaf.untyped_storage().resize_(0)
    return leaf.requires_grad_(like.requires_grad)


class _Fetch(torch.autograd.Function):
    """The fetched copies forward; their gradients to the leaves the graph read, backward."""

    @staticmethod
    def forward(ctx: Any, copies: tuple[torch.Tensor, ...], *leaves: torch.Tensor) -> Any:
        ctx.set_materialize_grads(False)
        return copies

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        return (None, *grads)


@dataclass
class _InFlight:
    key: tuple[tuple[int, int], ...]  # the host pieces' (identity, version) when issued
    transfers: list[Transfer]


class FetchParams(nn.Module):
    """One layer's offloaded parameters, copied up from host memory (module docstring).

    ``forward(*leaves)`` returns each parameter's fetched copy, and launches the copies of
    ``following`` (the program's next group) without waiting."""

    # set by the runtime when fetched weights are fetched again in backward: runtime.regather
    gathers: Any = None

    def __init__(self, pieces: Sequence[HostPiece], uplink: Uplink, names: Sequence[str]) -> None:
        super().__init__()
        self._pieces = tuple(pieces)
        self._uplink = uplink
        self.names = tuple(names)
        self.following: list[FetchParams] = []  # a list: not submodules
        self._inflight: _InFlight | None = None
        self.calls = Counter[str]()  # "prefetched" or "waited": how each forward found it

    def _key(self) -> tuple[tuple[int, int], ...]:
        """Where the host copies are and their versions: a prefetch of other values (moved,
        or written since) is not used."""
        pieces = [piece() for piece in self._pieces]
        return tuple((t.data_ptr(), t._version) for t in pieces)

    def prefetch(self) -> None:
        """Launch this group's copies without waiting (its ``forward`` takes them)."""
        if self._inflight is None:
            self._inflight = _InFlight(self._key(), self._uplink.copy_up(self._pieces, True))

    def drop_prefetch(self) -> None:
        """Forget a prefetch no forward took (one that stopped part way)."""
        self._inflight = None

    def forward(self, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inflight, self._inflight = self._inflight, None
        if inflight is not None and inflight.key == self._key():
            self.calls["prefetched"] += 1
            transfers = inflight.transfers
        else:
            self.calls["waited"] += 1
            transfers = self._uplink.copy_up(self._pieces, False)
        copies = tuple(t.wait() for t in transfers)
        values = _Fetch.apply(copies, *leaves)
        gathers = self.gathers
        if gathers is not None:
            refetch = Refetch(self._pieces, self._uplink, gathers.refetches)
            gathers.record_sources(values, [refetch.member(i) for i in range(len(values))])
        for following in self.following:
            following.prefetch()
        return values

    def extra_repr(self) -> str:
        return f"params={len(self._pieces)}"


class Refetch:
    """One forward's fetch group, fetched again in backward once for its saved members
    (the ``Source`` of their recipes, ``runtime.regather``): the first unpack copies up
    every member claimed, the last drops them."""

    def __init__(self, pieces: Sequence[HostPiece], uplink: Uplink, order: BackwardOrder) -> None:
        self._pieces = tuple(pieces)
        self._uplink = uplink
        self._claims = [0] * len(pieces)
        self._values: dict[int, torch.Tensor] | None = None
        self._inflight: dict[int, Transfer] | None = None
        self._order = order  # the order backward reaches the forward's groups

    def member(self, index: int) -> _Member:
        return _Member(self, index)

    @property
    def pending(self) -> bool:
        return any(n > 0 for n in self._claims)

    def claim(self, index: int) -> None:
        self._claims[index] += 1
        self._order.packed(self)

    def _copy_up(self, ahead: bool) -> dict[int, Transfer]:
        wanted = [i for i, n in enumerate(self._claims) if n > 0]
        transfers = self._uplink.copy_up([self._pieces[i] for i in wanted], ahead)
        return dict(zip(wanted, transfers, strict=True))

    def prefetch(self) -> None:
        """Launch the copies of the claimed members without waiting."""
        if self.pending and self._values is None and self._inflight is None:
            self._inflight = self._copy_up(True)

    def fetch(self, index: int) -> torch.Tensor:
        if self._values is None:
            inflight, self._inflight = self._inflight, None
            transfers = inflight if inflight is not None else self._copy_up(False)
            self._values = {i: t.wait() for i, t in transfers.items()}
            self._prefetch_next()
        value = self._values[index]
        self._claims[index] -= 1
        if not self.pending:  # kept only while claimed members remain
            self._values = None
        return value

    def _prefetch_next(self) -> None:
        """Launch the copies of the group backward fetches next (``BackwardOrder``)."""
        self._order.prefetch_after(self)


class _Member:
    """Parameter ``index`` of a ``Refetch``: a ``regather.Source``."""

    def __init__(self, refetch: Refetch, index: int) -> None:
        self._refetch = refetch
        self._index = index

    def claim(self) -> None:
        self._refetch.claim(self._index)

    def fetch(self) -> torch.Tensor:
        return self._refetch.fetch(self._index)


# --- the rewrite -------------------------------------------------------------------------


def fetch_params(
    program: fx.GraphModule,
    pieces: Mapping[str, HostPiece],
    layer_of: Mapping[str, int | None],
    uplink: Uplink,
) -> list[FetchParams]:
    """Rewrite ``program`` so that its reads of the parameters in ``pieces`` (by ``get_attr``
    target: each one's host copy) are fetched per layer (``layer_of``; None outside the
    layers, grouped per run between layers); returns the fetches of the program itself,
    in graph order, each prefetching the next. Reads inside recompute regions are fetched
    in the region (not prefetched: a region's fetch runs again in its recomputation)."""
    graph = program.graph
    _one_read_per_target(graph, pieces)
    groups: dict[str, list[fx.Node]] = {}
    grouped: set[fx.Node] = set()
    layers_seen: set[int] = set()
    regions: dict[fx.Node, list[int]] = {}  # a region call: its args that are offloaded reads
    for node in graph.nodes:  # by first use: the order the program needs them in
        read = [a for a in node.all_input_nodes if _reads(a, pieces)]
        if _is_region(program, node):
            regions[node] = [i for i, a in enumerate(node.args) if _reads(a, pieces)]
            continue
        for member in read:
            if member in grouped:
                continue
            grouped.add(member)
            layer = layer_of.get(str(member.target))
            if layer is None:
                place = f"outside{len(layers_seen)}"
            else:
                place = f"layer{layer}"
                layers_seen.add(layer)
            groups.setdefault(place, []).append(member)
    for call, positions in regions.items():
        _fetch_in_region(program, call, positions, pieces, uplink)
    for module in program.modules():
        sources = module.sources if isinstance(module, GatherParams) else None
        if sources is not None and any(t in pieces for t in sources.targets):
            # its shards exist only once fetched: the fetch before it is prefetched
            module.sources = None
    made = [
        _fetch_group(program, members, pieces, uplink, f"fetch_params_{place}")
        for place, members in groups.items()
    ]
    made = [m for m in made if m is not None]
    for fetch, following in itertools.pairwise(made):
        fetch.following = [following]
    if groups or regions:
        graph.lint()
        program.recompile()
    return made


def _one_read_per_target(graph: fx.Graph, pieces: Mapping[str, HostPiece]) -> None:
    """Every read of an offloaded parameter through its first ``get_attr``: one fetch each."""
    first: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        if not _reads(node, pieces):
            continue
        kept = first.setdefault(str(node.target), node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)


def _reads(node: Any, pieces: Mapping[str, HostPiece]) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr" and str(node.target) in pieces


def _is_region(program: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(
        program.get_submodule(str(node.target)), Recompute
    )


def _outside_regions(node: fx.Node, program: fx.GraphModule) -> list[fx.Node]:
    return [user for user in node.users if not _is_region(program, user)]


def _fetch_group(
    program: fx.GraphModule,
    members: list[fx.Node],
    pieces: Mapping[str, HostPiece],
    uplink: Uplink,
    base: str,
) -> FetchParams | None:
    """One ``FetchParams`` call before the first use (outside recompute regions) of any
    of ``members`` (``get_attr`` nodes, one per target); those uses read its outputs."""
    members = [m for m in members if _outside_regions(m, program)]
    if not members:
        return None
    graph = program.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min((u for m in members for u in _outside_regions(m, program)), key=order.__getitem__)
    targets = [str(m.target) for m in members]
    fetch = FetchParams([pieces[t] for t in targets], uplink, targets)
    name = free_name(program, base)
    program.add_submodule(name, fetch)
    with graph.inserting_before(first):
        call = graph.call_module(name, tuple(members))
    for member in members:
        if order[member] > order[first]:
            call.prepend(member)
    for index, member in enumerate(members):
        users = [u for u in _outside_regions(member, program) if u is not call]
        with graph.inserting_after(call):
            item = graph.call_function(operator.getitem, (call, index))
        item.meta = dict(member.meta)
        for user in users:
            user.replace_input_with(member, item)
    return fetch


def _fetch_in_region(
    program: fx.GraphModule,
    call: fx.Node,
    positions: list[int],
    pieces: Mapping[str, HostPiece],
    uplink: Uplink,
) -> None:
    """Fetch the offloaded parameters a recompute region reads inside its body: the region
    takes the storageless leaves, and its forward and its recomputation each copy them up."""
    region = program.get_submodule(str(call.target))
    assert isinstance(region, Recompute)
    body = region.body
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    members = [placeholders[i] for i in positions]
    targets = [str(call.args[i].target) for i in positions]  # type: ignore[union-attr]
    fetch = FetchParams([pieces[t] for t in targets], uplink, targets)
    name = free_name(body, "fetch_params")
    body.add_submodule(name, fetch)
    graph = body.graph
    with graph.inserting_after(placeholders[-1]):
        fetched = graph.call_module(name, tuple(members))
    for index, member in enumerate(members):
        users = [u for u in member.users if u is not fetched]
        with graph.inserting_after(fetched):
            item = graph.call_function(operator.getitem, (fetched, index))
        item.meta = dict(member.meta)
        for user in users:
            user.replace_input_with(member, item)
    graph.lint()
    body.recompile()
