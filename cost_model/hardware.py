"""Hardware presets: what one device and its links can do, read from YAML files.

A preset is a ``DevicePreset``: peak FLOP/s per dtype, memory capacity and bandwidth, the
intra-node and inter-node ``Link`` (bandwidth per device per direction, as nccl-tests quotes
bus bandwidth, and latency per collective step), and the fractions of those peaks a real
workload reaches. Four ship with autopar (``a100-80gb-sxm``, ``h100-sxm``, ``h200-sxm``,
``cpu``); the figures and their sources are in the YAML files under ``cost_model/presets/``.

Users add presets as files. A name is looked up, first match wins, in:

1. the directories in ``$AUTOPAR_PRESET_PATH`` (separated by ``os.pathsep``),
2. ``~/.config/autopar/presets/``,
3. the built-in ``cost_model/presets/``,

so a user file named ``h100-sxm.yaml`` overrides the shipped one. ``preset_dirs`` is the one
place that reads the environment.

>>> preset = load_preset("h100-sxm")
>>> preset.peak_flops["bfloat16"] / 1e12, preset.intra_node.bandwidth / 1e9
(989.4, 450.0)
>>> load_preset("h100")                                       # doctest: +SKIP
PresetError: unknown device preset 'h100'; known presets, closest first: h100-sxm, ...
"""

from __future__ import annotations

import difflib
import functools
import itertools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from autopar_plans.errors import PresetError, UsageError
from autopar_plans.files import PRESET_FILE, parse_yaml, read_text, require_file
from autopar_plans.io import describe_validation_error
from autopar_plans.units import parse_bytes
from autopar_plans.writes import write_atomic

PRESET_PATH_ENV = "AUTOPAR_PRESET_PATH"
USER_PRESET_DIR = Path("~/.config/autopar/presets")
BUILTIN_PRESET_DIR = Path(__file__).parent / "presets"
PRESET_SUFFIXES = (".yaml", ".yml")

# Keys of ``DevicePreset.peak_flops``: torch dtype names, plus "tfloat32" (fp32 matmuls on
# tensor cores) and "float8" (any 8-bit float format).
DTYPE_KEYS = ("float64", "float32", "tfloat32", "bfloat16", "float16", "float8")
# Keys of ``DevicePreset.op_rates``: op families whose achieved FLOP/s are measured.
OP_FAMILIES = ("matmul", "attention")
# Keys of ``Link.bandwidth_by_kind``: the collectives the cost model prices.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Link(_Strict):
    """One kind of link between devices (NVLink inside a node, InfiniBand across nodes)."""

    bandwidth: float = Field(
        gt=0,
        description="Bytes/s per device per direction (what nccl-tests calls bus bandwidth "
        "at its peak); NVLink's bidirectional figure halved.",
    )
    latency: float = Field(ge=0, description="Seconds per step of a collective (one ring hop).")
    bandwidth_by_kind: dict[str, float | list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="Bus bandwidth of particular collectives where it differs from "
        "``bandwidth``: one figure (gloo's all-gather runs at half its all-reduce's), or "
        "``[bytes, bus bandwidth]`` pairs by message size as measured (mid-sized messages "
        "reach less than large ones), read between them on a log scale of bytes. Keys: "
        "all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, p2p.",
    )

    @field_validator("bandwidth_by_kind")
    @classmethod
    def _known_kinds(
        cls, value: dict[str, float | list[tuple[float, float]]]
    ) -> dict[str, float | list[tuple[float, float]]]:
        unknown = sorted(set(value) - set(COLLECTIVE_KINDS))
        if unknown:
            raise ValueError(f"unknown collectives {unknown}; use {list(COLLECTIVE_KINDS)}")
        for kind, figure in value.items():
            points = [(1.0, figure)] if isinstance(figure, int | float) else figure
            if not points or any(not (size > 0 and bw > 0) for size, bw in points):
                raise ValueError(f"{kind}: bandwidths and sizes must be positive")
            if [size for size, _ in points] != sorted({size for size, _ in points}):
                raise ValueError(f"{kind}: sizes must grow from one pair to the next")
        return value

    def bandwidth_curve(self, kind: str) -> tuple[tuple[float, float], ...]:
        """``(bytes, bus bandwidth)`` points of collective ``kind``: its own, else the
        link's bandwidth at every size (one point)."""
        figure = self.bandwidth_by_kind.get(kind, self.bandwidth)
        if isinstance(figure, int | float):
            return ((1.0, float(figure)),)
        return tuple((float(size), float(bw)) for size, bw in figure)


def read_curve(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """The bandwidth at ``nbytes`` of a ``(bytes, bandwidth)`` curve: linear in the log of
    the size between its points, the end points' beyond them."""
    if nbytes <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (low, low_bw), (high, high_bw) in itertools.pairwise(points):
        if nbytes <= high:
            share = math.log(nbytes / low) / math.log(high / low)
            return low_bw + share * (high_bw - low_bw)
    return points[-1][1]


class OpOverhead(_Strict):
    """Host time to issue one op, beside the roofline time of its kernel: the dispatcher (and,
    in backward, the autograd engine's node) in eager PyTorch."""

    forward: float = Field(0.0, ge=0, description="Seconds per forward op.")
    backward: float = Field(0.0, ge=0, description="Seconds per backward op (autograd node).")
    asynchronous: bool = Field(
        True,
        description="The host queues kernels for an accelerator, which runs them while it "
        "issues the next: an op takes the longer of the two. False on a CPU, which runs the "
        "op after issuing it: the two add.",
    )

    def time(self, kernel_s: float, backward: bool = False) -> float:
        """An op's seconds given its kernel's (roofline) seconds."""
        host = self.backward if backward else self.forward
        return max(kernel_s, host) if self.asynchronous else kernel_s + host


class Efficiency(_Strict):
    """Fractions of the peaks that real kernels reach; the cost model multiplies peaks by them."""

    compute: float = Field(gt=0, le=1, description="Of peak FLOP/s, for large matmuls.")
    memory: float = Field(gt=0, le=1, description="Of peak memory bandwidth (STREAM-like copy).")
    network: float = Field(gt=0, le=1, description="Of link bandwidth (nccl-tests bus bandwidth).")


class SharedCores(_Strict):
    """``ranks`` ranks measured together on ``cores`` cores, one thread each (CPU ranks, more
    of them than cores: ``autopar calibrate --ranks``).

    The figures of such a preset are what one rank got while all ``ranks`` computed at once,
    ``min(1, cores / ranks)`` of a core each; with ``k`` computing, each gets
    ``min(1, cores / k)``: a rank that waits leaves its share to the others.
    """

    ranks: int = Field(ge=1)
    cores: float = Field(gt=0)

    def speed(self, busy: int) -> float:
        """How much faster than measured each of ``busy`` computing ranks runs.

        >>> shared = SharedCores(ranks=4, cores=2)
        >>> shared.speed(4), shared.speed(3), shared.speed(1)
        (1.0, 1.3333333333333333, 2.0)
        """
        share = min(1.0, self.cores / max(busy, 1))
        return share / min(1.0, self.cores / self.ranks)


class HostLink(_Strict):
    """The host a node's devices hang off: its memory and the link each device reaches it
    by (PCIe, NVLink-C2C), what offloading optimizer state, parameters or activations to
    the CPU is priced with (``autopar_cost_model.host``)."""

    memory_bytes: float = Field(gt=0, description="Host memory per node, bytes.")
    memory_bandwidth: float = Field(
        gt=0, description="Peak host memory bandwidth per node (all sockets), bytes/s."
    )
    to_device: float = Field(gt=0, description="Host-to-device bytes/s per device, peak.")
    from_device: float = Field(gt=0, description="Device-to-host bytes/s per device, peak.")
    latency: float = Field(0.0, ge=0, description="Seconds per copy, fixed.")
    efficiency: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Of the link's peak that pinned copies reach (an assumption until "
        "``autopar calibrate`` measures it on a GPU, where it writes the achieved "
        "bandwidths and 1).",
    )
    shared: bool = Field(
        False,
        description="The device's memory is the host's (a CPU device): moving state to "
        "the host frees nothing, so the planner offloads only when told to (the runtime's "
        "copies still run, which is how offload is tested without a GPU).",
    )
    optimizer_bandwidth: float | None = Field(
        None,
        gt=0,
        description="Bytes/s an optimizer step on the host reaches, per node, counted as "
        "``autopar_cost_model.optimizer.STEP_TRAFFIC`` counts a step's traffic; measured by "
        "``autopar calibrate`` (an AdamW step over fp32 values on the CPU): what a step's "
        "element-wise ops reach, rather than a copy's fraction of the DRAM's peak. None: "
        "``memory_bandwidth`` times the preset's ``efficiency.memory``.",
    )

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _size_with_unit(cls, value: Any) -> Any:
        return parse_bytes(value) if isinstance(value, str) else value


class DevicePreset(_Strict):
    """One device type and the node it sits in. All figures per device, in bytes and seconds.

    Treat a loaded preset as read-only: ``load_preset`` caches and shares it.
    """

    name: str = Field(min_length=1)
    description: str = ""
    peak_flops: dict[str, float] = Field(
        description=f"Dense peak FLOP/s keyed by dtype name: {', '.join(DTYPE_KEYS)}; "
        "float32 is required, the others where the device has them."
    )
    memory_bytes: float = Field(gt=0, description="Device memory capacity; '80GiB' is read too.")
    memory_bandwidth: float = Field(gt=0, description="Peak device memory bandwidth, bytes/s.")
    gpus_per_node: int = Field(ge=1, description="Devices that share the intra-node link.")
    intra_node: Link
    inter_node: Link
    launch_overhead: float = Field(
        0.0, ge=0, description="Seconds per collective call, on top of the per-step latency."
    )
    op_overhead: OpOverhead = Field(
        default_factory=OpOverhead, description="Host time per op (``autopar calibrate``)."
    )
    op_rates: dict[str, dict[str, list[tuple[float, float]]]] = Field(
        default_factory=dict,
        description="Measured FLOP/s of an op family (``matmul``, ``attention``) by dtype, "
        "as ``[FLOPs of one forward call, FLOP/s]`` pairs over sizes (``autopar "
        "calibrate``): small matmuls reach less of the peak than large ones. Where a "
        "family and dtype have a curve the roofline's compute term reads it (between the "
        "points on a log scale) instead of the peak times ``efficiency.compute``.",
    )
    in_step: float = Field(
        1.0,
        gt=0,
        description="How much longer an op's kernel takes inside a training step than "
        "alone, where its figures were measured (caches shared with the other ops' "
        "tensors, inputs in the layouts the op before left): every op's roofline time is "
        "multiplied by it. ``autopar calibrate`` fits it to a reference step "
        "(``autopar_cost_model.reference_step``); 1 for the shipped presets.",
    )
    comm_overlap: float = Field(
        1.0,
        ge=0,
        le=1,
        description="The fraction of the communication that may hide behind compute which "
        "compute really hides: 1 where collectives run beside the kernels (NCCL on its own "
        "links), less where they need the cores compute runs on (gloo on a busy CPU).",
    )
    shared_cores: SharedCores | None = Field(
        None,
        description="Where the figures were measured by several CPU ranks sharing fewer "
        "cores: the ranks and the cores. A pipeline's devices that wait in its bubble leave "
        "their cores to the busy ones (``autopar_cost_model.schedule``). None: a device each.",
    )
    host: HostLink | None = Field(
        None,
        description="The node's host memory and the device-host link (offload); None: "
        "not known for this preset.",
    )
    efficiency: Efficiency

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _size_with_unit(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return parse_bytes(value)
        except UsageError as err:
            raise ValueError(str(err)) from None

    @field_validator("op_rates")
    @classmethod
    def _known_families(
        cls, value: dict[str, dict[str, list[tuple[float, float]]]]
    ) -> dict[str, dict[str, list[tuple[float, float]]]]:
        unknown = sorted(set(value) - set(OP_FAMILIES))
        if unknown:
            raise ValueError(f"unknown op families {unknown}; use {list(OP_FAMILIES)}")
        for family, curves in value.items():
            bad = sorted(set(curves) - set(DTYPE_KEYS))
            if bad:
                raise ValueError(f"{family}: unknown dtype keys {bad}; use {list(DTYPE_KEYS)}")
            for dtype, points in curves.items():
                if not points or any(not (f > 0 and r > 0) for f, r in points):
                    raise ValueError(f"{family}.{dtype}: FLOPs and rates must be positive")
                if [f for f, _ in points] != sorted({f for f, _ in points}):
                    raise ValueError(f"{family}.{dtype}: FLOPs must grow from pair to pair")
        return value

    @field_validator("peak_flops")
    @classmethod
    def _known_dtypes(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - set(DTYPE_KEYS))
        if unknown:
            raise ValueError(f"unknown dtype keys {unknown}; use {list(DTYPE_KEYS)}")
        if "float32" not in value:
            raise ValueError("float32 is required")
        bad = sorted(k for k, v in value.items() if not v > 0)
        if bad:
            raise ValueError(f"peaks must be positive, not for {bad}")
        return value

    def link(self, crosses_nodes: bool) -> Link:
        """The inter-node link if ``crosses_nodes``, else the intra-node one."""
        return self.inter_node if crosses_nodes else self.intra_node


def preset_dirs(environ: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    """The directories searched for preset files, first match wins (see the module docstring).

    The only place autopar reads ``$AUTOPAR_PRESET_PATH``; pass ``environ`` to override it.
    """
    env = os.environ if environ is None else environ
    extra = [Path(p).expanduser() for p in env.get(PRESET_PATH_ENV, "").split(os.pathsep) if p]
    return (*extra, USER_PRESET_DIR.expanduser(), BUILTIN_PRESET_DIR)


def preset_files(dirs: tuple[Path, ...] | None = None) -> dict[str, Path]:
    """Preset name (the file's stem) -> file, over ``dirs`` (default ``preset_dirs()``)."""
    found: dict[str, Path] = {}
    for directory in preset_dirs() if dirs is None else dirs:
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix in PRESET_SUFFIXES and path.is_file():
                found.setdefault(path.stem, path)
    return found


def known_preset_names() -> list[str]:
    return sorted(preset_files())


def load_preset(name_or_path: str | Path) -> DevicePreset:
    """The preset called ``name_or_path``, or the one in that YAML file.

    A string ending in ``.yaml``/``.yml`` or containing a path separator is a file; anything
    else is a name. Raises ``PresetError`` for an unknown name (listing the known ones,
    closest first), a missing file, or a file that is not a valid preset (naming the field).
    """
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or text.endswith(PRESET_SUFFIXES) or os.sep in text:
        path = require_file(Path(text).expanduser(), PRESET_FILE)
        return _read_preset(str(path.resolve()), path.stat().st_mtime_ns, None)
    files = preset_files()
    if text not in files:
        raise PresetError(unknown_preset_message(text, list(files)))
    path = files[text]
    return _read_preset(str(path), path.stat().st_mtime_ns, text)


def list_presets() -> list[DevicePreset]:
    """Every preset found by name, sorted by name."""
    return [load_preset(name) for name in known_preset_names()]


def unknown_preset_message(name: str, known: list[str]) -> str:
    closest = sorted(known, key=lambda k: (-difflib.SequenceMatcher(None, name, k).ratio(), k))
    return (
        f"unknown device preset {name!r}; known presets, closest first: {', '.join(closest)}. "
        f"Pass a preset file's path, or add NAME.yaml to {USER_PRESET_DIR}/ or to a directory "
        f"in ${PRESET_PATH_ENV} (`autopar calibrate` writes one for this machine)"
    )


@functools.lru_cache(maxsize=64)
def _read_preset(path: str, mtime_ns: int, expected_name: str | None) -> DevicePreset:
    """Parse one preset file; cached by path and modification time (a pure function of both)."""
    del mtime_ns  # part of the cache key only: an edited file is read again
    data: Any = parse_yaml(read_text(path, PRESET_FILE), path, PRESET_FILE)
    if not isinstance(data, dict):
        raise PresetError(
            f"{path}: a preset file holds a mapping of fields, found {type(data).__name__}"
        )
    try:
        preset = DevicePreset.model_validate(data)
    except ValidationError as err:
        raise PresetError(
            f"{path}: not a valid device preset:\n{describe_validation_error(err)}"
        ) from None
    if expected_name is not None and preset.name != expected_name:
        raise PresetError(
            f"{path}: the file is named {expected_name!r} but declares name "
            f"{preset.name!r}; make the two match"
        )
    return preset


def dump_preset(preset: DevicePreset, header: str = "") -> str:
    """The preset as YAML text that ``load_preset`` reads back; ``header`` becomes comments."""
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comments + yaml.safe_dump(preset.model_dump(mode="json"), sort_keys=False, width=100)


def save_preset(preset: DevicePreset, path: str | Path, header: str = "") -> Path:
    """Write ``preset`` as YAML to ``path`` (parents created); returns the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, dump_preset(preset, header))  # an interrupted write keeps the old one
    return path
