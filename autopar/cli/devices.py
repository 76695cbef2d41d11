"""`autopar devices`: list the hardware presets, built-in and the user's own.

    $ autopar devices
    name           bf16 TFLOP/s  memory GiB  HBM GB/s  intra GB/s  inter GB/s  per node
    a100-80gb-sxm         312.0        80.0   2,039.0       300.0        25.0         8
    ...

Bandwidths are per device per direction (nccl-tests' bus bandwidth at its peak), before the
preset's efficiency. ``--format json`` prints every field of every preset.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from autopar.cli.render import console
from autopar_cost_model.compute import peak_flops
from autopar_cost_model.hardware import DevicePreset, list_presets, preset_dirs

COLUMNS = ("name", "bf16 TFLOP/s", "memory GiB", "HBM GB/s", "intra GB/s", "inter GB/s", "per node")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "devices",
        help="list the hardware presets",
        description="List the hardware presets: the shipped ones and those in "
        "$AUTOPAR_PRESET_PATH and ~/.config/autopar/presets/ (a user file overrides a "
        "shipped one of the same name).",
    )
    parser.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="a table (default) or every field as JSON",
    )
    parser.set_defaults(run=run)


def _number(value: float) -> str:
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def preset_row(preset: DevicePreset) -> tuple[str, ...]:
    """One table row: the figures a user compares devices by."""
    bf16 = peak_flops(preset, "bfloat16") or 0.0
    return (
        preset.name,
        _number(bf16 / 1e12),
        _number(preset.memory_bytes / 2**30),
        _number(preset.memory_bandwidth / 1e9),
        _number(preset.intra_node.bandwidth / 1e9),
        _number(preset.inter_node.bandwidth / 1e9),
        str(preset.gpus_per_node),
    )


def _print_table(rows: list[tuple[str, ...]]) -> None:
    table = Table(box=None, pad_edge=False)
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console().print(table)


def run(args: argparse.Namespace) -> int:
    presets = list_presets()
    if args.format == "json":
        print(json.dumps([p.model_dump(mode="json") for p in presets], indent=2))
        return 0
    _print_table([preset_row(p) for p in presets])
    print("\nsearched, first match wins: " + ", ".join(str(d) for d in preset_dirs()))
    return 0
