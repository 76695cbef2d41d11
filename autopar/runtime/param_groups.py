"""FSDP's flat gathers: the sharded parameters of one layer all-gathered in one collective.

The lowering gathers each parameter stored sharded on its own, right before its use
(``autopar_passes.lower_spmd``): for a Llama block that is ten all-gathers forward, ten
reduce-scatters backward (their adjoints) and ten gathers again in backward
(``runtime.regather``). Each collective pays a fixed latency whatever its size, and on a
tiny model that latency is most of the step. FSDP2 (``fully_shard`` per block) pays it
once per block and direction: the block's shards lie end to end in one flat buffer that
one all-gather fills, and the gradients go back through one reduce-scatter.

``group_param_gathers`` rewrites a rank's program the same way. The all-gathers whose input
is a parameter (a ``get_attr``) are grouped by mesh axis, dtype and layer of the layer
container (parameters outside the layers: each run of them between layers is one group,
so the embedding is not held through the forward for the head); each group becomes one
``GatherParams`` call, placed before the group's first gather, whose outputs replace the
single gathers. Its backward is one reduce-scatter of the group's gradients; in backward,
the first saved weight of the group that is unpacked gathers the whole group once for
all its saved weights (``GroupRegather``), which are dropped after the last of them.

**Prefetch**, as FSDP2 does: when a group is gathered in forward, the next group of the
program is launched without waiting (``GatherParams.following``), so its all-gather runs
while this group's layer computes; in backward, when a group is gathered again, the group
backward reaches next is launched the same way: the order is FSDP2's, the reverse of the
order the groups' weights were last saved in forward (``regather.BackwardOrder``), so a
tied embedding that the head keeps comes first. Only the first gather of a forward and the
first regather of a backward wait for nothing to hide them. The plan's ledger prices them
by the same rule (``autopar_passes.ledger.hide_prefetched``).

Values are those of the single gathers: the same pieces concatenated along the same dims,
the same gradient sums.

>>> group_param_gathers(program, {"layers.0.mlp.up.weight": 0, ...})  # doctest: +SKIP
5
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autopar.runtime.collectives import (
    AllGather,
    Collective,
    Group,
    all_gather_rows,
    reduce_scatter_rows,
    start_all_gather_rows,
    to_param_dtype,
    unflatten,
)
from autopar.runtime.faults import Waitable
from autopar.runtime.regather import BackwardOrder
from autopar_plans.errors import UsageError

Shape = tuple[int, ...]


def _pieces(whole: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``whole`` seen as its ``n`` pieces along ``dim``: a ``[n, *piece shape]`` view."""
    return whole.unflatten(dim, (n, whole.shape[dim] // n)).movedim(dim, 0)


def _offsets(shapes: Sequence[Shape]) -> list[tuple[int, int]]:
    """Where each shard lies in the flat buffer of a group: ``(start, stop)``."""
    spans, start = [], 0
    for shape in shapes:
        stop = start + _numel(shape)
        spans.append((start, stop))
        start = stop
    return spans


def _numel(shape: Shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass
class InFlight:
    """A group's all-gather launched ahead of its use: the work, the rows it fills, and
    the (identity, version) of the shards it gathered, so that rows of parameters that
    changed since (an optimizer step) are never used."""

    work: Waitable
    rows: torch.Tensor
    key: tuple[tuple[int, int], ...]

    def rows_for(self, key: tuple[tuple[int, int], ...]) -> torch.Tensor | None:
        """The rows, once gathered, if they are of the shards ``key`` names."""
        self.work.wait()
        return self.rows if key == self.key else None


def shard_key(shards: Sequence[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    return tuple((id(shard), shard._version) for shard in shards)


def launch_gather(
    shards: Sequence[torch.Tensor], group: Group, key: tuple[tuple[int, int], ...]
) -> InFlight:
    """``gather_group``'s all-gather, launched without waiting."""
    flat = torch.cat([shard.detach().reshape(-1) for shard in shards])
    work, rows = start_all_gather_rows(flat, group)
    return InFlight(work, rows, key)


def gather_group(
    shards: Sequence[torch.Tensor],
    dims: Sequence[int],
    group: Group,
    into: Sequence[torch.Tensor] | None = None,
    rows: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Each shard all-gathered along its dim, in one collective: the shards laid end to end
    in one flat buffer, gathered as rows (one per device), each whole copied out of them,
    into ``into`` when given (tensors of the wholes' shapes: ZeRO's working copies, filled
    in place rather than copied again). ``rows``: the gather's result, when a prefetch
    (``launch_gather``) made it already."""
    n = group.size
    if rows is None:
        flat = torch.cat([shard.detach().reshape(-1) for shard in shards])
        rows = all_gather_rows(flat, group)  # [n, sum of shard numels]
    wholes = []
    spans = _offsets([tuple(shard.shape) for shard in shards])
    for index, (shard, dim, (start, stop)) in enumerate(zip(shards, dims, spans, strict=True)):
        shape = list(shard.shape)
        shape[dim] *= n
        if into is None:
            whole = torch.empty(shape, dtype=shard.dtype, device=shard.device)
        else:
            whole = into[index]
        _pieces(whole, n, dim).copy_(rows[:, start:stop].view(n, *shard.shape))
        wholes.append(whole)
    return wholes


def reduce_scatter_group(
    grads: Sequence[torch.Tensor | None],
    shapes: Sequence[Shape],
    dims: Sequence[int],
    group: Group,
    like: torch.Tensor,
) -> list[torch.Tensor]:
    """The adjoint of ``gather_group``: each whole gradient's pieces summed over devices,
    this device's piece kept, in one collective (a missing gradient counts as zeros).
    The results are views of one flat buffer of the group's shard size."""
    flat = reduce_scatter_rows(scatter_rows(grads, shapes, dims, group, like), group)
    return unflatten(flat, [torch.Size(shape) for shape in shapes])


def scatter_rows(
    grads: Sequence[torch.Tensor | None],
    shapes: Sequence[Shape],
    dims: Sequence[int],
    group: Group,
    like: torch.Tensor,
) -> torch.Tensor:
    """The ``[n, numel]`` rows that ``reduce_scatter_group`` sums: row ``r`` holds every
    gradient's ``r``-th piece along its dim (of ``shapes``), end to end."""
    n = group.size
    spans = _offsets(shapes)
    rows = torch.empty((n, spans[-1][1]), dtype=like.dtype, device=like.device)
    for grad, shape, dim, (start, stop) in zip(grads, shapes, dims, spans, strict=True):
        piece = rows[:, start:stop].view(n, *shape)
        if grad is None:
            piece.zero_()
        else:
            piece.copy_(_pieces(grad, n, dim))
    return rows


class _GatherGroup(torch.autograd.Function):
    """``gather_group`` forward (from prefetched ``rows`` when given),
    ``reduce_scatter_group`` backward."""

    @staticmethod
    def forward(
        ctx: Any,
        dims: tuple[int, ...],
        group: Group,
        rows: torch.Tensor | None,
        *shards: torch.Tensor,
    ) -> Any:
        ctx.dims, ctx.group = dims, group
        ctx.shapes = [tuple(shard.shape) for shard in shards]
        ctx.like = shards[0].new_empty(0)  # dtype and device of the gradients' buffer
        ctx.set_materialize_grads(False)  # an unused weight's gradient: no zeros made
        return tuple(gather_group(shards, dims, group, rows=rows))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        pieces = reduce_scatter_group(grads, ctx.shapes, ctx.dims, ctx.group, ctx.like)
        return (None, None, None, *pieces)


class GroupRegather:
    """One forward's group of parameters, gathered again in backward once for all of the
    group's saved weights (the ``Source`` of their recipes, ``runtime.regather``).

    Every saved weight of the group is claimed when packed; the first unpack gathers the
    group, the last one drops it. So the group's whole weights live in backward while the
    layer's backward runs, as FSDP's do (and, without this, each saved weight would cost
    a collective of its own).
    """

    def __init__(
        self,
        shards: Sequence[torch.Tensor],
        dims: Sequence[int],
        group: Group,
        order: BackwardOrder,
        sources: Sequence[Any] | None = None,
    ):
        """``sources``: where to have the shards again (``regather.Source``s) instead of
        keeping them, when they are not the parameters' own (fetched from host memory,
        ``runtime.param_offload``): each is claimed once per gather of the group."""
        self._sources = tuple(sources) if sources is not None else None
        self._shards = tuple(shards) if sources is None else ()
        self._launched: tuple[torch.Tensor, ...] = ()
        self._dims = tuple(dims)
        self._group = group
        self._pending = 0
        self._wholes: list[torch.Tensor] | None = None
        self._inflight: InFlight | None = None
        self._order = order  # the order backward reaches the forward's groups
        self.prefetched: bool | None = None  # whether backward found its gather launched

    def member(self, index: int) -> _Member:
        return _Member(self, index)

    def claim(self) -> None:
        if self._pending == 0 and self._sources is not None:
            for source in self._sources:  # this group will fetch its shards once
                source.claim()
        self._pending += 1
        self._order.packed(self)

    @property
    def pending(self) -> bool:
        """Backward will still fetch this group."""
        return self._pending > 0

    def _current_shards(self) -> tuple[torch.Tensor, ...]:
        if self._sources is None:
            return self._shards
        return tuple(source.fetch() for source in self._sources)

    def prefetch(self) -> None:
        """Launch this group's gather without waiting, if backward will fetch it."""
        if self._pending > 0 and self._wholes is None and self._inflight is None:
            with torch.no_grad():
                shards = self._current_shards()
                self._inflight = launch_gather(shards, self._group, ())
                self._launched = shards  # until the gather is taken (fetched shards)

    def fetch(self, index: int) -> torch.Tensor:
        wholes = self._wholes
        if wholes is None:
            inflight, self._inflight = self._inflight, None
            rows = inflight.rows_for(()) if inflight is not None else None
            self.prefetched = rows is not None
            with torch.no_grad():
                shards = self._current_shards() if rows is None else self._launched
                self._launched = ()
                wholes = gather_group(shards, self._dims, self._group, rows=rows)
            self._prefetch_next()
        self._pending -= 1
        # kept only while claimed weights remain (a second backward gathers each anew)
        self._wholes = wholes if self._pending > 0 else None
        return wholes[index]

    def _prefetch_next(self) -> None:
        """Launch the gather of the group backward fetches next (FSDP2's backward
        prefetch, in its post-forward order: ``regather.BackwardOrder``)."""
        self._order.prefetch_after(self)


class _Member:
    """Parameter ``index`` of a ``GroupRegather``: a ``regather.Source``."""

    def __init__(self, regather: GroupRegather, index: int) -> None:
        self._regather = regather
        self._index = index

    def claim(self) -> None:
        self._regather.claim()

    def fetch(self) -> torch.Tensor:
        return self._regather.fetch(self._index)


@dataclass
class _Sources:
    """Where a group's shards are read from outside its call: the program's attributes
    (a weak reference: the program owns the group)."""

    program: weakref.ref[fx.GraphModule]
    targets: tuple[str, ...]

    def __call__(self) -> list[torch.Tensor]:
        program = self.program()
        assert program is not None
        return [operator.attrgetter(target)(program) for target in self.targets]


class GatherParams(Collective):
    """All-gathers of several parameters over one mesh axis, as one collective.

    ``forward(*shards)`` returns each shard gathered along its dim in ``dims``, and
    launches the gather of ``following`` (the program's next group) without waiting."""

    # set by the runtime when gathered weights are regathered in backward: runtime.regather
    gathers: Any = None
    # the dtype the group is gathered in (FSDP2's param_dtype; autopar_passes.mixed_precision)
    param_dtype: torch.dtype | None = None

    def __init__(self, group: Group, axis_name: str, dims: tuple[int, ...]) -> None:
        super().__init__(group, axis_name)
        self.dims = dims
        self.sources: _Sources | None = None  # the shards, for a prefetch
        self.following: list[GatherParams] = []  # the next group (a list: not a submodule)
        self._inflight: InFlight | None = None
        self.calls = Counter[str]()  # "prefetched" or "waited": how each forward found it

    def prefetch(self) -> None:
        """Launch this group's gather without waiting (its ``forward`` takes the rows)."""
        if self._inflight is None and self.sources is not None:
            shards = self.sources()
            cast = [to_param_dtype(shard.detach(), self.param_dtype) for shard in shards]
            self._inflight = launch_gather(cast, self.group, shard_key(shards))

    def forward(self, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len({shard.dtype for shard in shards}) > 1:
            raise UsageError(
                "parameters gathered together (one FSDP group) have different dtypes "
                f"({sorted({str(s.dtype) for s in shards})}); cast the compiled model as a "
                "whole (compiled.to(dtype)), not parameter by parameter"
            )
        inflight, self._inflight = self._inflight, None
        rows = inflight.rows_for(shard_key(shards)) if inflight is not None else None
        self.calls["prefetched" if rows is not None else "waited"] += 1
        shards = tuple(to_param_dtype(shard, self.param_dtype) for shard in shards)
        wholes = _GatherGroup.apply(self.dims, self.group, rows, *shards)
        if self.gathers is not None:
            regather = GroupRegather(
                shards,
                self.dims,
                self.group,
                self.gathers.regathers,
                sources=self.gathers.sources_of(shards),
            )
            self.gathers.record_sources(wholes, [regather.member(i) for i in range(len(shards))])
        for following in self.following:
            following.prefetch()
        return wholes

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, params={len(self.dims)}"


def group_param_gathers(
    program: fx.GraphModule,
    layer_of: Mapping[str, int | None],
    cast: frozenset[str] = frozenset(),
    compute: torch.dtype | None = None,
) -> int:
    """Replace ``program``'s all-gathers of parameters by one ``GatherParams`` per group;
    returns how many groups were made.

    ``layer_of`` maps the ``get_attr`` target of each parameter that may be grouped to its
    layer in the layer container (None: outside the layers). Recompute regions leave
    parameters' gathers outside them (``autopar_passes.lower_recompute``), so a recomputed
    layer's are grouped like any other's.
    The parameters in ``cast`` are gathered in ``compute`` (``autopar_passes.mixed_precision``),
    in groups of their own.
    """
    groups = _param_gather_groups(program, layer_of, cast, compute)
    made = []
    for key, members in groups.items():
        dtype = compute if key[1] == str(compute) else None
        made.append(
            _gather_as_group(program, members, _group_name(program, members[0], key), dtype)
        )
    for gather, following in itertools.pairwise(made):
        gather.following = [following]  # in graph order: each launches the next (prefetch)
    if groups:
        program.graph.lint()
        program.recompile()
    return len(groups)


GroupKey = tuple[str, str, str]  # (all-gather module, dtype, "layer3" or "outside1")


def _param_gather_groups(
    program: fx.GraphModule,
    layer_of: Mapping[str, int | None],
    cast: frozenset[str],
    compute: torch.dtype | None,
) -> dict[GroupKey, list[fx.Node]]:
    """The all-gathers of parameters in graph order, grouped; parameters outside the layers
    are grouped per run between layers (the embedding apart from the head)."""
    groups: dict[GroupKey, list[fx.Node]] = {}
    layers_seen: set[int] = set()
    for node in program.graph.nodes:
        if not _gathers_param(program, node, layer_of):
            continue
        target = node.args[0].target
        layer = layer_of[target]
        if layer is None:
            place = f"outside{len(layers_seen)}"
        else:
            place = f"layer{layer}"
            layers_seen.add(layer)
        stored = _read(program, target).dtype
        dtype = str(compute if target in cast and compute is not None else stored)
        groups.setdefault((str(node.target), dtype, place), []).append(node)
    return groups


def _gathers_param(
    program: fx.GraphModule, node: fx.Node, layer_of: Mapping[str, int | None]
) -> bool:
    """Whether ``node`` is ``all_gather(parameter, dim)`` over one mesh axis."""
    if node.op != "call_module" or node.kwargs or len(node.args) != 2:
        return False
    source, dim = node.args
    return (
        isinstance(program.get_submodule(str(node.target)), AllGather)
        and isinstance(source, fx.Node)
        and source.op == "get_attr"
        and source.target in layer_of
        and isinstance(dim, int)
    )


def _group_name(program: fx.GraphModule, first: fx.Node, key: GroupKey) -> str:
    """``all_gather_dp_params_layer0``; unique in the (shared) module tree."""
    base = f"{first.target}_params_{key[2]}"
    name, suffix = base, 1
    while hasattr(program, name):
        name, suffix = f"{base}_{suffix}", suffix + 1
    return name


def _gather_as_group(
    program: fx.GraphModule, members: list[fx.Node], name: str, dtype: torch.dtype | None
) -> GatherParams:
    """One ``GatherParams`` call before the first member; each member becomes its output."""
    graph = program.graph
    single = program.get_submodule(str(members[0].target))
    assert isinstance(single, AllGather)
    sources = [member.args[0] for member in members]
    dims = tuple(_dim(program, member) for member in members)
    gather = GatherParams(single.group, single.axis_name, dims)
    gather.param_dtype = dtype
    targets = tuple(str(source.target) for source in sources if isinstance(source, fx.Node))
    gather.sources = _Sources(weakref.ref(program), targets)
    program.add_submodule(name, gather)
    order = {node: i for i, node in enumerate(graph.nodes)}
    with graph.inserting_before(members[0]):
        grouped = graph.call_module(name, tuple(sources))
    for source in sources:
        assert isinstance(source, fx.Node)
        if order[source] > order[members[0]]:  # read later: move the read up (no inputs)
            grouped.prepend(source)
    for index, member in enumerate(members):
        with graph.inserting_before(member):
            item = graph.call_function(operator.getitem, (grouped, index))
        item.meta = dict(member.meta)
        member.replace_all_uses_with(item)
        graph.erase_node(member)
    return gather


def _dim(program: fx.GraphModule, member: fx.Node) -> int:
    """The member's gather dim, counted from the front."""
    source, dim = member.args
    assert isinstance(source, fx.Node) and isinstance(dim, int)
    return dim % _read(program, str(source.target)).dim()


def _read(program: fx.GraphModule, target: str) -> torch.Tensor:
    """What the ``get_attr`` of ``target`` reads: a parameter's local tensor."""
    value = operator.attrgetter(target)(program)
    assert isinstance(value, torch.Tensor)
    return value
