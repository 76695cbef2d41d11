"""Hints: a few layouts and choices written by the model's author; the planner does the rest.

GShard let authors annotate a few tensors and propagated the rest; here the annotations
come in a YAML file (``docs/hints.md`` is the reference)::

    mesh: {shape: [2, 4], axes: [dp, tp]}             # checked against the real mesh
    shard:
      "layers.*.attn.q_proj.weight": [tp, null]       # a spec: one mesh axis per tensor dim
      "layers.*.mlp.down_proj.weight": [null, tp]
    replicate: ["embed_tokens.weight"]
    pipeline: {stages: 4, schedule: 1f1b, microbatches: 16}   # or cuts: [0, 8, 16, 24]
    no_recompute: ["layers.*.mlp"]
    memory_limit: 60GiB
    ban: {dp: [tensor_parallel]}                      # per mesh axis, see BAN_KINDS

This module is the file's schema and nothing more: it reads the YAML, keeps the line of
every key (so an error says ``hints.yaml:7``), validates the shape of each value, and lists
the hints one by one (``Hints.items``). Whether a hint fits the model and the mesh is
checked by ``autopar_passes.hints``, which has the traced model.

>>> hints = hints_from_text('shard:\\n  "layers.*.q.weight": [tp, null]\\n', "h.yaml")
>>> [str(h) for h in hints.items()]
['h.yaml:2: shard "layers.*.q.weight": [tp, null]']

**Names** are matched by glob (``name_matches``): ``*`` stands for any characters within one
dotted component, ``**`` for any characters across components, ``?`` for one character,
``[...]`` for a character class; the pattern must match the whole name.
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)
from pydantic import model_validator as _model_validator

from autopar_plans.compression import GradCompression
from autopar_plans.errors import HintError, InfeasiblePlanError, UsageError
from autopar_plans.files import HINT_FILE, parse_yaml_tree, read_text
from autopar_plans.offload import offload_request
from autopar_plans.units import parse_bytes

BanKind = Literal["tensor_parallel", "fsdp", "sequence_parallel", "data_parallel"]

BAN_KINDS: dict[str, str] = {
    "tensor_parallel": "no matmul or embedding takes a weight split (or a partial sum of it) "
    "over the axis while its "
    "activation is not split on a token dim there (Megatron's column/row splits, vocab splits)",
    "fsdp": "no parameter is stored split over the axis (FSDP/ZeRO-3); an op may still "
    "compute on a slice of the whole copy",
    "sequence_parallel": "no residual add ([batch, sequence, hidden] + the same) is split "
    "on the sequence dim over the axis",
    "data_parallel": "no matmul or embedding takes its activation split on a token dim "
    "(batch or sequence) over the axis",
}
"""The words ``ban`` takes, each a predicate on one node's strategy (``autopar_passes.hints``)."""

Schedule = Literal["gpipe", "1f1b", "interleaved"]
SpecEntry = str | None | tuple[str, ...]
# where a key sits in the file: a path of mapping keys and sequence indices
KeyPath = tuple[str | int, ...]


class HintConflictError(InfeasiblePlanError):
    """Hints that no plan satisfies together; the message names a minimal set of them."""


def _spec_entry(entry: Any) -> SpecEntry:
    axes = [entry] if isinstance(entry, str) else entry
    if entry is not None and (
        not isinstance(axes, list | tuple) or any(not isinstance(a, str) or not a for a in axes)
    ):
        raise ValueError(
            f"{entry!r} is not a spec entry; write a mesh axis name, null, or a list of "
            "axis names for each tensor dim"
        )
    return tuple(entry) if isinstance(entry, list) else entry


def _spec(value: Any) -> Any:
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"{value!r} is not a spec; write a list with one entry per tensor dim, such as "
            "[tp, null]"
        )
    return tuple(_spec_entry(entry) for entry in value)


Spec = Annotated[tuple[Any, ...], BeforeValidator(_spec)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MeshHint(_Strict):
    """The mesh the hints were written for; each given field must match the real mesh."""

    shape: tuple[int, ...] | None = Field(None, description="Devices along each axis.")
    axes: tuple[str, ...] | None = Field(None, description="Axis names, outermost first.")

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if shape is not None and (not shape or any(size < 1 for size in shape)):
            raise ValueError("every axis size must be a positive integer")
        return shape


class PipelineHint(_Strict):
    """Fixed parts of the pipeline search; what is left out is searched."""

    stages: int | None = Field(None, ge=1, description="Pipeline stages over the outer axis.")
    schedule: Schedule | None = None
    microbatches: int | None = Field(None, ge=1, description="Microbatches per step.")
    chunks: int | None = Field(None, ge=1, description="Stages per device (interleaved).")
    cuts: tuple[int, ...] | None = Field(
        None, description="Layer indices where the stages begin (the first is 0)."
    )

    @field_validator("cuts")
    @classmethod
    def _increasing(cls, cuts: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if cuts is None:
            return None
        if not cuts:
            raise ValueError("list the layer where each stage begins, such as [0, 8, 16, 24]")
        if cuts[0] != 0:
            cuts = (0, *cuts)  # the first stage always begins at layer 0
        if any(b <= a for a, b in itertools.pairwise(cuts)):
            raise ValueError(f"cuts {list(cuts)} must increase: one layer index per stage")
        return cuts

    @_model_validator(mode="after")
    def _consistent(self) -> PipelineHint:
        if self.cuts is not None and self.stages is not None and self.stages != len(self.cuts):
            raise ValueError(
                f"stages: {self.stages} but cuts {list(self.cuts)} make {len(self.cuts)} stages"
            )
        if self.cuts is not None and self.schedule == "interleaved":
            raise ValueError("interleaved 1F1B cuts the layers into equal chunks; drop cuts")
        if self.chunks not in (None, 1) and self.schedule not in (None, "interleaved"):
            raise ValueError(f"chunks: {self.chunks} needs schedule: interleaved")
        return self

    @property
    def stage_count(self) -> int | None:
        """Stages fixed by ``stages`` or implied by ``cuts``."""
        return self.stages if self.stages is not None else (len(self.cuts) if self.cuts else None)


class Hints(_Strict):
    """A hint file, validated. Build one with ``load_hints`` (file) or ``hints_from_text``."""

    mesh: MeshHint | None = None
    shard: dict[str, Spec] = Field(
        default_factory=dict,
        description="Glob on parameter names (else module paths: the module's output) -> "
        "spec, one mesh axis (or null, or a list of axes) per tensor dim.",
    )
    replicate: tuple[str, ...] = Field((), description="Globs, as shard, held whole.")
    pipeline: PipelineHint | None = None
    recompute: tuple[str, ...] = Field((), description="Module globs to recompute.")
    no_recompute: tuple[str, ...] = Field((), description="Module globs never recomputed.")
    memory_limit: str | int | float | None = Field(None, description="Per device: 60GiB.")
    ban: dict[str, tuple[BanKind, ...]] = Field(
        default_factory=dict, description="Mesh axis -> kinds of parallelism banned on it."
    )
    grad_compression: GradCompression | None = Field(
        None,
        description="Compress the data-parallel gradient sum: a scheme name or its "
        "fields (autopar_plans.compression; docs/communication.md).",
    )
    offload: str | dict[str, Any] | None = Field(
        None,
        description="What may live in host memory: auto, none, kinds (optimizer, "
        "activations, parameters; parameters forces the optimizer on too), or kind -> on / "
        "off / auto (autopar_plans.offload).",
    )
    _source: str = PrivateAttr(default="<hints>")
    _lines: dict[KeyPath, int] = PrivateAttr(default_factory=dict)

    @field_validator("shard")
    @classmethod
    def _patterns_of_shard(cls, shard: dict[str, tuple[SpecEntry, ...]]) -> dict[str, Any]:
        for pattern in shard:
            _check_pattern(pattern)
        return shard

    @field_validator("replicate", "recompute", "no_recompute")
    @classmethod
    def _patterns(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            _check_pattern(pattern)
        return patterns

    @field_validator("grad_compression", mode="before")
    @classmethod
    def _scheme(cls, value: Any) -> Any:
        return {"scheme": value} if isinstance(value, str) else value

    @field_validator("offload")
    @classmethod
    def _offload(cls, value: Any) -> Any:
        offload_request(value)  # ValueError: pydantic reports it with the key's line
        return value

    @field_validator("memory_limit")
    @classmethod
    def _bytes(cls, value: str | int | float | None) -> str | int | float | None:
        if value is not None:
            try:
                parse_bytes(value)
            except UsageError as error:
                raise ValueError(str(error)) from None
        return value

    @property
    def source(self) -> str:
        """The file the hints came from (``<hints>`` when built in code)."""
        return self._source

    def line(self, *path: str | int) -> int | None:
        """The line of the key at ``path`` (or of the nearest enclosing key), if known."""
        for end in range(len(path), 0, -1):
            line = self._lines.get(tuple(path[:end]))
            if line is not None:
                return line
        return None

    def where(self, *path: str | int) -> str:
        """``hints.yaml:7``: the file and the line of the key at ``path``."""
        line = self.line(*path)
        return f"{self._source}:{line}" if line is not None else self._source

    @property
    def memory_limit_bytes(self) -> float | None:
        return None if self.memory_limit is None else float(parse_bytes(self.memory_limit))

    def items(self) -> list[Hint]:
        """Every hint as one ``Hint``, in file order: the units that a conflict names."""
        found: list[Hint] = []
        for pattern, spec in self.shard.items():
            found.append(Hint("shard", self.where("shard", pattern), pattern, spec=tuple(spec)))
        for i, pattern in enumerate(self.replicate):
            found.append(Hint("replicate", self.where("replicate", i), pattern))
        for axis, kinds in self.ban.items():
            for i, kind in enumerate(kinds):
                found.append(Hint("ban", self.where("ban", axis, i), axis, ban=kind))
        if self.memory_limit is not None:
            found.append(Hint("memory_limit", self.where("memory_limit"), str(self.memory_limit)))
        if self.pipeline is not None:
            found.append(Hint("pipeline", self.where("pipeline"), _describe_pipeline(self)))
        for key in ("recompute", "no_recompute"):
            for i, pattern in enumerate(getattr(self, key)):
                found.append(Hint(key, self.where(key, i), pattern))  # type: ignore[arg-type]
        return sorted(found, key=lambda h: _line_of(h.where))


@dataclass(frozen=True)
class Hint:
    """One hint of a file, and where it was written (``hints.yaml:7``).

    ``kind`` ``"shard"``: ``pattern`` -> ``spec``; ``"replicate"``, ``"recompute"``,
    ``"no_recompute"``: ``pattern``; ``"ban"``: ``pattern`` is the mesh axis, ``ban`` the
    kind; ``"memory_limit"``, ``"pipeline"``: ``pattern`` is the value as written.
    """

    kind: Literal[
        "shard", "replicate", "ban", "memory_limit", "pipeline", "recompute", "no_recompute"
    ]
    where: str
    pattern: str
    spec: tuple[SpecEntry, ...] = field(default=())
    ban: str = ""

    @property
    def text(self) -> str:
        """The hint as it reads in the file, without its place."""
        if self.kind == "shard":
            return f'shard "{self.pattern}": {format_user_spec(self.spec)}'
        if self.kind == "ban":
            return f"ban {self.pattern}: {self.ban}"
        if self.kind in ("memory_limit", "pipeline"):
            return f"{self.kind}: {self.pattern}"
        return f'{self.kind} "{self.pattern}"'

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def format_user_spec(spec: Sequence[SpecEntry]) -> str:
    """``[tp, null]``, ``[[dp, tp], null]``: a spec as it is written in a hint file."""

    def one(entry: SpecEntry) -> str:
        if entry is None:
            return "null"
        if isinstance(entry, str):
            return entry
        return "[" + ", ".join(entry) + "]"

    return "[" + ", ".join(one(e) for e in spec) + "]"


def _describe_pipeline(hints: Hints) -> str:
    assert hints.pipeline is not None
    values = hints.pipeline.model_dump(exclude_none=True)
    return "{" + ", ".join(f"{k}: {v}" for k, v in values.items()) + "}"


def _line_of(where: str) -> int:
    tail = where.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _check_pattern(pattern: str) -> None:
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError("a name pattern must not be empty")
    if pattern.count("[") != pattern.count("]"):
        raise ValueError(f"{pattern!r}: unbalanced [ ] in the glob")


# ---- glob matching ------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``*`` within one dotted component, ``**`` across them, ``?`` one character, ``[..]``."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append(r"[^.]*")
        elif char == "?":
            out.append(r"[^.]")
        elif char == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out) + r"\Z")


def name_matches(pattern: str, name: str) -> bool:
    """Whether the glob ``pattern`` matches the whole dotted ``name``.

    >>> name_matches("layers.*.attn.q_proj.weight", "layers.11.attn.q_proj.weight")
    True
    >>> name_matches("layers.*.weight", "layers.0.attn.q_proj.weight")
    False
    >>> name_matches("layers.**.weight", "layers.0.attn.q_proj.weight")
    True
    """
    return _glob_regex(pattern).match(name) is not None


def is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def closest_names(pattern: str, names: Iterable[str], count: int = 3) -> list[str]:
    """The real names nearest to a pattern that matched nothing, for the error message.

    Numbered components (``layers.7``) are shown as ``*`` when the pattern has wildcards, so
    one suggestion stands for every layer.
    """
    pool = set(names)
    if is_glob(pattern):
        pool = {".".join("*" if p.isdigit() else p for p in n.split(".")) for n in pool}
    return difflib.get_close_matches(pattern, sorted(pool), n=count, cutoff=0.4)


# ---- reading ------------------------------------------------------------------------------


def load_hints(path: str | Path) -> Hints:
    """Read and validate a hint file; errors name the file and the line."""
    return hints_from_text(read_text(path, HINT_FILE), str(path))


def hints_from_text(text: str, source: str = "<hints>") -> Hints:
    """Validate hints written as YAML text, keeping the line of every key.

    Any text ends in ``Hints`` or one ``HintError``: the YAML is read with limits on size,
    nesting and aliases (``autopar_plans.files``), so a bomb is refused, not expanded.
    """
    data, node = parse_yaml_tree(text, source, HINT_FILE)
    lines: dict[KeyPath, int] = {}
    if node is not None:
        _record_lines(node, (), lines, source)
    return hints_from_dict({} if data is None else data, source, lines)


def hints_from_dict(
    data: Any, source: str = "<hints>", lines: Mapping[KeyPath, int] | None = None
) -> Hints:
    """Validate hints given as a mapping (the parsed YAML, or written in code)."""
    if isinstance(data, Hints):
        return data
    if not isinstance(data, Mapping):
        raise HintError(
            f"{source}: a hint file holds a mapping (shard:, replicate:, ...), found "
            f"{type(data).__name__}"
        )
    known = list(Hints.model_fields)
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            where = f"{source}:{lines[(key,)]}" if lines and (key,) in lines else source
            raise HintError(f"{where}: {key!r} is not a hint{hint} (hints: {', '.join(known)})")
    try:
        hints = Hints.model_validate(dict(data))
    except ValidationError as error:
        raise HintError(_describe(error, source, lines or {})) from None
    hints._source = source
    hints._lines = dict(lines or {})
    return hints


def as_hints(value: str | Path | Mapping[str, Any] | Hints) -> Hints:
    """A ``Hints`` from a file path, a mapping, or ``Hints`` already made."""
    if isinstance(value, Hints):
        return value
    if isinstance(value, Mapping):
        return hints_from_dict(value)
    if isinstance(value, str | Path):
        return load_hints(value)
    raise HintError(
        f"hints must be a YAML file path, a mapping or plans.Hints, got {type(value).__name__}"
    )


def _record_lines(node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int], source: str) -> None:
    """Walk the composed YAML tree, noting the 1-based line of every key and item."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                raise HintError(
                    f"{source}:{line}: {key!r} is written twice (first on line {seen[key]}); "
                    "a key may appear once"
                )
            seen[key] = line
            lines[(*path, key)] = line
            _record_lines(value_node, (*path, key), lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _record_lines(item, (*path, i), lines, source)


def _describe(error: ValidationError, source: str, lines: Mapping[KeyPath, int]) -> str:
    """One line per problem: ``hints.yaml:7: ban.node.0: Input should be ...``."""
    out: list[str] = []
    for problem in error.errors():
        loc = tuple(problem["loc"])
        path: KeyPath = tuple(
            part for part in loc if isinstance(part, str | int) and not _is_type_tag(part)
        )
        line = None
        for end in range(len(path), 0, -1):
            line = lines.get(path[:end])
            if line is not None:
                break
        where = f"{source}:{line}" if line is not None else source
        field_name = ".".join(str(p) for p in path) or "(top level)"
        message = problem["msg"].removeprefix("Value error, ")
        text = f"{where}: {field_name}: {message}"
        if text not in out:
            out.append(text)
    return "\n".join(out)


def _is_type_tag(part: str | int) -> bool:
    """pydantic puts the union member tried into the location (``str``, ``list[str]``)."""
    return isinstance(part, str) and part in {"str", "list[str]", "none", "int", "float"}
