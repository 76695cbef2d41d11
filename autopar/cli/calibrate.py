"""`autopar calibrate`: measure this machine and write a preset file for it.

    $ autopar calibrate --quick -o local.yaml
    ...
    wrote local.yaml; plan with it by passing --device local.yaml

Without ``-o`` the file goes to ``~/.config/autopar/presets/NAME.yaml``, where ``autopar
devices`` lists it and ``--device NAME`` finds it. What is measured and what is borrowed
from a shipped preset is written in the file's header (see ``autopar_cost_model.calibrate``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar_cost_model.hardware import USER_PRESET_DIR, dump_preset
from autopar_plans.errors import UsageError
from autopar_plans.writes import cannot_write, write_atomic

if TYPE_CHECKING:
    from autopar_cost_model.calibrate import Calibration


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure this machine and write a device preset",
        description="Measure matmul FLOP/s per dtype, memory bandwidth and collective bus "
        "bandwidth on this machine (its first GPU, else the CPU), and its host: an AdamW "
        "step on the CPU and, with a GPU, copies between host and device; write them as a "
        "preset.",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        type=Path,
        help=f"where to write the preset (default: {USER_PRESET_DIR}/NAME.yaml)",
    )
    parser.add_argument("--name", help="the preset's name (default: local-cpu, local-<gpu>)")
    parser.add_argument(
        "--quick", action="store_true", help="short, small measurements (seconds, less precise)"
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        metavar="N",
        help="on a CPU: the preset describes one of N ranks sharing this machine (one "
        "thread each, as local gloo ranks run), its share of compute and memory "
        "(default: the whole machine, all its threads)",
    )
    parser.add_argument(
        "--skip-collectives",
        action="store_true",
        help="do not start processes to measure the collectives",
    )
    parser.set_defaults(run=run)


def with_in_step(result: Calibration) -> Calibration:
    """The calibration with ``in_step`` fitted to its reference step
    (``autopar_passes.reference_step``:
    fitting needs the tracer, which ``cost_model`` may not import)."""
    from autopar_passes.reference_step import fit_in_step

    in_step = round(fit_in_step(result.preset, result.reference_step_s), 3)
    note = (
        f"in_step: the reference step (autopar_cost_model.reference_step) took "
        f"{result.reference_step_s * 1e3:.1f} ms forward and backward, {in_step:g}x what its "
        "ops' figures predict (each op timed alone); every op's time is scaled by it"
    )
    return result._replace(
        preset=result.preset.model_copy(update={"in_step": in_step}),
        notes=(*result.notes, note),
    )


def run(args: argparse.Namespace) -> int:
    from autopar_cost_model.calibrate import calibrate, default_name, summary_rows  # imports torch

    name = args.name or default_name()
    if not name or os.sep in name or name.endswith((".yaml", ".yml")):
        raise UsageError(
            f"--name {name!r}: give a plain name such as 'my-cluster'; use -o for the file"
        )
    output = Path(args.output or USER_PRESET_DIR.expanduser() / f"{name}.yaml").expanduser()
    make_folder(output)  # before measuring: a bad -o fails in a second, not a minute
    result = calibrate(
        name=name, quick=args.quick, collectives=not args.skip_collectives, ranks=args.ranks
    )
    result = with_in_step(result)
    path = write_atomic(output, dump_preset(result.preset, "\n".join(result.notes)))
    rows = summary_rows(result.preset, result.host_link_source)
    width = max(len(label) for label, _ in rows)
    print(f"preset {result.preset.name!r}: {result.preset.description}")
    for label, value in rows:
        print(f"  {label.ljust(width)}  {value}")
    for note in result.notes[1:]:
        print(f"  note: {note}")
    how = f"--device {name}" if args.output is None else f"--device {path}"
    print(f"wrote {path}; plan with it by passing {how}")
    return 0


def make_folder(output: Path) -> None:
    """Create the preset's folder (and its parents), or say in one line why not."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(cannot_write(output, error)) from None
