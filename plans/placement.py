"""Placements and layouts: how one tensor lies on a device mesh.

Two spellings of the same thing, and the words kept apart: a mesh *axis* is a dimension of
the device mesh, a tensor *dim* is a dimension of the tensor.

- DTensor's: a ``Layout`` holds one placement per mesh axis: ``Shard(dim)`` (the tensor is
  split along ``dim`` over that axis), ``Replicate()`` (every device on the axis holds all
  of it) or ``Partial()`` (each holds a summand; the sum is the value).
- JAX's (used in hints and on the CLI): a *spec* holds one entry per tensor dim, naming the
  mesh axis that splits it, several axes (in mesh order), or ``None``.

>>> layout = layout_from_spec(["dp", None, "tp"], axis_names=("dp", "tp"))
>>> layout
Layout(S(0), S(2))
>>> spec_from_layout(layout, axis_names=("dp", "tp"), ndim=3)
['dp', None, 'tp']

Placements serialise to short strings (``"S(0)"``, ``"R"``, ``"P(sum)"``) so plan files stay
readable; ``Layout`` serialises to a list of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    model_serializer,
    model_validator,
)

from autopar_plans.errors import UsageError

SpecEntry = str | None | tuple[str, ...] | list[str]


class Shard(BaseModel):
    """The tensor is split evenly along tensor dim ``dim`` over one mesh axis."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["shard"] = "shard"
    dim: int = Field(ge=0)

    def __init__(self, dim: int | None = None, /, **data: Any) -> None:
        if dim is not None:
            data["dim"] = dim
        super().__init__(**data)

    def __repr__(self) -> str:
        return f"S({self.dim})"

    __str__ = __repr__

    @model_serializer
    def _to_str(self) -> str:
        return repr(self)


class Replicate(BaseModel):
    """Every device on the mesh axis holds the whole tensor."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["replicate"] = "replicate"

    def __repr__(self) -> str:
        return "R"

    __str__ = __repr__

    @model_serializer
    def _to_str(self) -> str:
        return "R"


class Partial(BaseModel):
    """Each device on the mesh axis holds a partial value; ``reduce_op`` of them is the value."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["partial"] = "partial"
    reduce_op: Literal["sum", "avg", "max"] = "sum"

    def __repr__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"

    __str__ = __repr__

    @model_serializer
    def _to_str(self) -> str:
        return f"P({self.reduce_op})"


_PLACEMENT_RE = re.compile(r"^\s*(?:(S)\((\d+)\)|(R)|(P)(?:\((sum|avg|max)\))?)\s*$")


def parse_placement(value: Any) -> Shard | Replicate | Partial:
    """Read a placement from its string form (``"S(1)"``, ``"R"``, ``"P(sum)"``) or a dict."""
    if isinstance(value, Shard | Replicate | Partial):
        return value
    if isinstance(value, str):
        match = _PLACEMENT_RE.match(value)
        if match is None:
            raise ValueError(f"{value!r} is not a placement; write S(<dim>), R or P(sum)")
        if match.group(1):
            return Shard(int(match.group(2)))
        if match.group(3):
            return Replicate()
        return Partial(reduce_op=match.group(5) or "sum")
    if isinstance(value, dict):
        kind = value.get("kind")
        cls = {"shard": Shard, "replicate": Replicate, "partial": Partial}.get(kind)
        if cls is None:
            raise ValueError(f"unknown placement kind {kind!r}")
        return cls.model_validate(value)
    raise ValueError(f"{value!r} is not a placement")


Placement = Annotated[Shard | Replicate | Partial, BeforeValidator(parse_placement)]

REPLICATE = Replicate()
PARTIAL = Partial()


class Layout(BaseModel):
    """One placement per mesh axis, in mesh order (DTensor's ``placements``)."""

    model_config = ConfigDict(frozen=True)
    placements: tuple[Placement, ...]
    # the solver hashes and compares layouts millions of times: keep a key of the
    # placements' strings, read from pydantic's private dict directly (attribute access to
    # a private attribute goes through ``__getattr__``, ten times slower)
    _key: tuple[str, ...] | None = PrivateAttr(default=None)

    def _cached_key(self) -> tuple[str, ...]:
        private = self.__pydantic_private__
        assert private is not None
        key = private["_key"]
        if key is None:
            key = private["_key"] = tuple(repr(p) for p in self.placements)
        return key

    def __hash__(self) -> int:
        return hash(self._cached_key())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self is other or self._cached_key() == other._cached_key()

    def __init__(self, *placements: Any, **data: Any) -> None:
        if placements:
            data["placements"] = tuple(placements)
        super().__init__(**data)

    @classmethod
    def replicated(cls, mesh_ndim: int) -> Layout:
        return cls(*([REPLICATE] * mesh_ndim))

    def __iter__(self) -> Iterator[Shard | Replicate | Partial]:  # type: ignore[override]
        return iter(self.placements)

    def __len__(self) -> int:
        return len(self.placements)

    def __getitem__(self, axis: int) -> Shard | Replicate | Partial:
        return self.placements[axis]

    def __repr__(self) -> str:
        return "Layout(" + ", ".join(map(repr, self.placements)) + ")"

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.placements)) + "]"

    @model_serializer
    def _to_list(self) -> list[str]:
        return [p._to_str() for p in self.placements]

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return {"placements": tuple(value)}
        return value

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def sharded_dims(self) -> dict[int, list[int]]:
        """Tensor dim -> mesh axes that split it, in mesh order."""
        dims: dict[int, list[int]] = {}
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                dims.setdefault(placement.dim, []).append(axis)
        return dims

    def shard_factor(self, mesh_shape: Sequence[int]) -> int:
        """How many pieces the tensor is cut into (the product of sharding axes' sizes)."""
        factor = 1
        for size, placement in zip(mesh_shape, self.placements, strict=True):
            if isinstance(placement, Shard):
                factor *= size
        return factor

    def local_shape(
        self, global_shape: Sequence[int], mesh_shape: Sequence[int]
    ) -> tuple[int, ...]:
        """The shape each device holds, assuming even splits (checked by ``check_divisible``)."""
        shape = list(global_shape)
        for size, placement in zip(mesh_shape, self.placements, strict=True):
            if isinstance(placement, Shard):
                shape[placement.dim] //= size
        return tuple(shape)

    def divides(self, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
        """Whether every sharded dim splits evenly over its axes."""
        shape = list(global_shape)
        for size, placement in zip(mesh_shape, self.placements, strict=True):
            if isinstance(placement, Shard):
                if placement.dim >= len(shape) or shape[placement.dim] % size:
                    return False
                shape[placement.dim] //= size
        return True


def _spec_axes(entry: SpecEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def layout_from_spec(spec: Sequence[SpecEntry], axis_names: Sequence[str]) -> Layout:
    """Convert the JAX spelling (one mesh axis or ``None`` per tensor dim) to a ``Layout``.

    Raises ``UsageError`` for an unknown axis, an axis used twice, or several axes on one
    dim listed out of mesh order (DTensor shards by the earlier mesh axis first).
    """
    names = list(axis_names)
    placements: list[Shard | Replicate | Partial] = [REPLICATE] * len(names)
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        axes = _spec_axes(entry)
        positions = []
        for axis in axes:
            if axis not in names:
                raise UsageError(
                    f"spec {list(spec)}: unknown mesh axis {axis!r}; the mesh has axes {names}"
                )
            if axis in seen:
                raise UsageError(f"spec {list(spec)}: mesh axis {axis!r} is used twice")
            seen.add(axis)
            positions.append(names.index(axis))
            placements[names.index(axis)] = Shard(dim)
        if positions != sorted(positions):
            raise UsageError(
                f"spec {list(spec)}: list the axes that split dim {dim} in mesh order "
                f"({[names[p] for p in sorted(positions)]})"
            )
    return Layout(*placements)


def spec_from_layout(
    layout: Layout, axis_names: Sequence[str], ndim: int
) -> list[str | tuple[str, ...] | None]:
    """Convert a ``Layout`` to the JAX spelling. A ``Partial`` placement has no spelling there."""
    spec: list[str | tuple[str, ...] | None] = [None] * ndim
    for dim, axes in layout.sharded_dims().items():
        if dim >= ndim:
            raise UsageError(f"{layout!r} shards dim {dim} of a {ndim}-d tensor")
        names = tuple(axis_names[a] for a in axes)
        spec[dim] = names[0] if len(names) == 1 else names
    for axis, placement in enumerate(layout):
        if isinstance(placement, Partial):
            raise UsageError(
                f"{layout!r} is partial over mesh axis {axis_names[axis]!r}; "
                "a spec can only say sharded or replicated"
            )
    return spec


def format_spec(layout: Layout, axis_names: Sequence[str], ndim: int) -> str:
    """A one-line display of a layout in the JAX spelling, partial axes noted after it.

    >>> format_spec(Layout(Shard(1), Partial()), ("dp", "tp"), 2)
    '[None, dp] partial(tp)'
    """
    spec: list[str] = ["None"] * ndim
    for dim, axes in layout.sharded_dims().items():
        names = [axis_names[a] for a in axes]
        spec[dim] = names[0] if len(names) == 1 else "(" + ",".join(names) + ")"
    text = "[" + ", ".join(spec) + "]"
    partial = [axis_names[a] for a, p in enumerate(layout) if isinstance(p, Partial)]
    if partial:
        text += " partial(" + ",".join(partial) + ")"
    return text


def zero_axes(param: Layout, optimizer: Layout, mesh_shape: Sequence[int]) -> list[tuple[int, int]]:
    """ZeRO-1/2: ``(mesh axis, dim)`` for each axis that replicates a parameter but shards
    its optimizer state along ``dim`` (empty for every other parameter)."""
    return [
        (axis, o.dim)
        for axis, (p, o) in enumerate(zip(param, optimizer, strict=True))
        if isinstance(p, Replicate) and isinstance(o, Shard) and mesh_shape[axis] > 1
    ]
