"""Regenerate BENCHMARKS.md: ``python -m benchmarks`` from the repository root.

    python -m benchmarks                      # the default sections, then the whole file
    python -m benchmarks --quick              # smoke run of every section on tiny models
    python -m benchmarks --only runtime gpu   # some sections; the others as last recorded
    python -m benchmarks --full               # also the heavy sections (hours on 2 cores)
    python -m benchmarks --render             # no measuring: the file from the records
    python -m benchmarks --only quality --resume --cases gpt3-13b@64   # one more case
    python -m benchmarks --only quality --full --resume --again llama3-70b@64  # plan anew

Sections (in the file's order): trace, speed (planning speed and its plots), quality (plan
quality against DDP, FSDP and Megatron; heavy), frontier (recompute frontier; heavy),
pipeline (the search on gpt3-175b over 128x8), runtime (real gloo ranks), communication
(compression and local SGD planned on 16x8 H100s, a straggler on gloo ranks), gpu (the saved
H200 run, read, not rerun). Each section's record, with the command, the date and the
machine, goes to ``RESULTS/<section>.json``; the document is rendered from the records, so
every figure in it comes with the command that measured it. ``--quick`` writes to a fresh
temporary directory unless ``--out``/``--results`` say otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from autopar_plans.writes import write_atomic
from benchmarks import render
from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ("trace", "speed", "pipeline", "runtime", "communication", "gpu")
HEAVY = ("quality", "frontier")
ALL = ("trace", "speed", "quality", "frontier", "pipeline", "runtime", "communication", "gpu")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps")
    parser.add_argument("--full", action="store_true", help="also the heavy sections")
    parser.add_argument("--only", nargs="+", choices=ALL, metavar="SECTION", help=", ".join(ALL))
    parser.add_argument("--render", action="store_true", help="measure nothing")
    parser.add_argument(
        "--resume", action="store_true", help="quality: keep the cases already recorded"
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=[],
        metavar="MODEL@DEVICES",
        help="quality: also plan these cases (such as gpt3-13b@64), after the run's own",
    )
    parser.add_argument(
        "--again",
        nargs="+",
        default=[],
        metavar="MODEL@DEVICES",
        help="quality, with --resume: plan these recorded cases again",
    )
    parser.add_argument("--out", type=Path, help="the document (default: BENCHMARKS.md)")
    parser.add_argument(
        "--results", type=Path, help="the records' folder (default: benchmarks/results/cpu)"
    )
    args = parser.parse_args(argv)
    from benchmarks.quality import parse_case

    try:
        args.cases = [parse_case(text) for text in args.cases]
        args.again = [parse_case(text) for text in args.again]
    except ValueError as error:
        parser.error(str(error))
    if args.again and not args.resume:
        parser.error("--again plans recorded cases anew: use it with --resume")
    if args.quick and (args.out is None or args.results is None):
        scratch = Path(tempfile.mkdtemp(prefix="autopar-benchmarks-"))
        args.out = args.out or scratch / "BENCHMARKS.md"
        args.results = args.results or scratch / "results"
    args.out = args.out or ROOT / "BENCHMARKS.md"
    args.results = args.results or ROOT / "benchmarks" / "results" / "cpu"
    return args


def to_run(args: argparse.Namespace) -> tuple[str, ...]:
    if args.render:
        return ()
    if args.only:
        return tuple(s for s in ALL if s in args.only)
    if args.full or args.quick:
        return ALL
    return DEFAULT


def command(argv: list[str]) -> str:
    return " ".join(["python -m benchmarks", *argv]).strip()


def load(results: Path) -> dict[str, Any]:
    """The sections' records; a quality run stopped before its last case counts with the
    cases it finished (its record says ``partial``)."""
    records = {}
    for name in ALL:
        path = results / f"{name}.json"
        if path.exists():
            records[name] = json.loads(path.read_text())
    partial = results / "quality.partial.json"
    if "quality" not in records and partial.exists():
        record = json.loads(partial.read_text())
        if "section" in record:  # older partial files hold the cases only
            records["quality"] = record
    return records


def make_record(
    name: str, argv: list[str], info: dict[str, Any], load_average: Any, data: Any, wall: float
) -> dict[str, Any]:
    """What a section's run leaves in ``benchmarks/results``: its data, and how, when and
    where it was measured."""
    return {
        "section": name,
        "command": command(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": info,
        "load_average": load_average,
        "wall_s": data.get("seconds", wall) if isinstance(data, dict) else wall,
        "quick": "--quick" in argv,
        "data": data,
    }


def save(results: Path, name: str, record: dict[str, Any]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    write_atomic(results / f"{name}.json", json.dumps(record, indent=1, default=str) + "\n")


def measure(name: str, args: argparse.Namespace, stash: dict[str, Any]) -> Any:
    """Run one section; its data (what the renderer reads). ``stash`` carries the planning
    record that the trace section's run produced alongside (one set of traces for both)."""
    if name in ("trace", "speed"):
        from benchmarks import speed

        if name in stash:
            return stash.pop(name)
        if name == "trace" and "speed" not in to_run(args):
            rows, _ = speed.trace_rows(speed.QUICK_MODELS if args.quick else speed.MODELS)
            return {"rows": rows}
        stash["trace"], stash["speed"] = speed.run(args.quick)
        return stash.pop(name)
    if name == "quality":
        from benchmarks import quality

        replaced = args.results / "quality.json"  # the record this run replaces
        previous = json.loads(replaced.read_text()) if replaced.exists() else None
        done = None
        if args.resume:
            for stored in ("quality.partial.json", "quality.json"):
                path = args.results / stored
                if path.exists():
                    stored_record = json.loads(path.read_text())
                    cases = stored_record["data"]["cases"]
                    for case in cases:  # kept as measured: say where (older cases do not)
                        case.setdefault("commit", stored_record["machine"].get("commit", "?"))
                    done = {f"{c['model']}@{c['devices']}": c for c in cases}
                    break
            for model, devices in args.again:
                if done is not None:
                    done.pop(f"{model}@{devices}", None)
        data = quality.run(
            quick=args.quick,
            full=args.full,
            extra=args.cases,
            done=done,
            save=lambda partial: save(
                args.results,
                "quality.partial",
                make_record(*stash["_meta"], partial, partial.get("seconds", 0.0))
                | {"partial": True},
            ),
        )
        (args.results / "quality.partial.json").unlink(missing_ok=True)  # complete now
        if previous is not None and not args.quick:
            data["previous"] = quality.previous_summary(previous)
        return data
    from benchmarks import runtime, sections

    if name == "frontier":
        return sections.frontier(args.quick)
    if name == "pipeline":
        return sections.pipeline(args.quick)
    if name == "runtime":
        return runtime.run(args.quick)
    if name == "communication":
        from benchmarks import communication

        return communication.run(args.quick)
    if name == "gpu":
        return sections.gpu()
    raise ValueError(name)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    records = load(args.results)
    info = machine()
    sections = to_run(args)
    print(f"sections: {', '.join(sections) or 'none (render only)'}; records in {args.results}")
    stash: dict[str, Any] = {"_records": dict(records)}
    for name in sections:
        start = time.perf_counter()
        load_average = os.getloadavg()
        print(f"[{name}] ...", flush=True)
        stash["_meta"] = (name, argv, info, load_average)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = measure(name, args, stash)
        wall = time.perf_counter() - start
        records[name] = make_record(name, argv, info, load_average, data, wall)
        save(args.results, name, records[name])
        print(f"[{name}] done in {wall:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figures = render.plots(records, args.out.parent)
    render.write(args.out, records)
    print(f"wrote {args.out}" + (f" and {', '.join(figures)}" if figures else ""))


if __name__ == "__main__":
    main()
