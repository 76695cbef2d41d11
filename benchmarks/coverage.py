"""The op-coverage sweep: every architecture of the installed transformers that builds from a
small config (no download), traced, planned and run on a 2x2 CPU mesh.

    python -m benchmarks.coverage                   # all; writes RESULTS and docs/coverage.md
    python -m benchmarks.coverage --only llama t5   # some; the others as last recorded
    python -m benchmarks.coverage --resume          # those not recorded yet
    python -m benchmarks.coverage --render          # docs/coverage.md from the record

Per architecture, in a worker process (a memory cap of ``MEMORY`` and a time limit of
``SECONDS``, so one that blows up is a row, not a crash; ``Worker``): built with
``autopar_examples.models.hf_zoo.hf_auto`` (its config's size fields small), one eager
training step, ``autopar.trace``, ``autopar.plan`` on a 2x2 mesh (the ops without a sharding
rule are those its warnings name), then one training step compiled on 4 gloo ranks with the
solver's free choice next to the same step on one device: equal when the loss and every
gradient are within 1e-4 of the step in float64, relative to the tensor's largest value,
or as close to it as the fp32 roundoff allows (``autopar.testing.closeness``: 8 times the
single device's own distance from float64, plus 4 ulps of the largest value). The second
limit is for gradients that are zero in exact arithmetic (a router whose choice the loss
cannot feel), which come out as roundoff, different in every order of summation.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import multiprocessing
import re
import resource
import time
import warnings
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from autopar_plans.writes import write_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cpu" / "coverage.json"
REPORT = ROOT / "docs" / "coverage.md"
MEMORY = 6 * 2**30
SECONDS = 300
ROWS_PER_WORKER = 10
MAX_PARAMETERS = 20_000_000
RELATIVE = 1e-4
STAGES = ("built", "eager", "traced", "planned", "equal")
NO_RULE = re.compile(r"no sharding rule for (\S+)")


def _mesh() -> Any:
    """The 2x2 CPU mesh every architecture is planned and run on."""
    import autopar

    return autopar.Mesh((2, 2), device="cpu")


def _gradients(model: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    loss = model(**kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _distance(got: Any, single: Any, exact: Any) -> float:
    """How far ``got`` is from float64, in units of the larger of two limits (1 is the
    limit): ``RELATIVE`` of the tensor's largest value, or what the fp32 roundoff allows
    (``autopar.testing.closeness``), which covers a gradient that is zero in exact
    arithmetic (its largest value is itself roundoff). No gradient is a zero gradient."""
    import torch

    from autopar.testing.closeness import allowed_error

    if exact is None:  # the loss does not reach the parameter
        return 0.0 if got is None or not bool(torch.as_tensor(got).any()) else float("inf")
    exact = exact.double()
    got = got.double() if got is not None else torch.zeros_like(exact)
    single = single.double() if single is not None else None
    error = float((got - exact).abs().max()) if exact.numel() else 0.0
    if error == 0:
        return 0.0
    scale = float(exact.abs().max())
    limits = [RELATIVE * scale]
    if single is not None:  # the fp32 roundoff, measured against float64
        limits.append(allowed_error(single, exact))
    return min(error / limit if limit > 0 else float("inf") for limit in limits)


def one_step(rank: int, world: int, model_type: str) -> dict[str, Any] | None:
    """On every rank: the architecture's compiled step on a 2x2 mesh next to one device's
    in fp32 and (rank 0) in float64; rank 0 returns the worst distance (``_distance``) and
    the plan's parallelism."""
    import autopar
    from autopar_examples.models.hf_zoo import double_inputs, hf_auto, in_float64

    model, kwargs = hf_auto(model_type)
    ref_loss, ref_grads = _gradients(copy.deepcopy(model), kwargs)
    exact_loss, exact_grads = None, {}
    if rank == 0:
        try:  # a model that makes float32 tensors of its own cannot run in float64
            exact_loss, exact_grads = _gradients(in_float64(model), double_inputs(kwargs))
        except (RuntimeError, TypeError, ValueError):
            exact_loss, exact_grads = None, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = autopar.compile(model, _mesh(), example_kwargs=kwargs)
    loss = compiled(**kwargs).loss
    loss.backward()
    grads = {name: compiled.full_gradient(name) for name in ref_grads}  # every rank
    if rank:
        return None
    if exact_loss is None:  # no float64 run: the relative limit against fp32 alone
        exact_loss, exact_grads, ref_loss, ref_grads = ref_loss, ref_grads, None, {}
    distances = {"loss": _distance(loss.detach(), ref_loss, exact_loss)}
    for name, grad in grads.items():
        distances[name] = _distance(grad, ref_grads.get(name), exact_grads[name])
    worst = max(distances, key=distances.__getitem__)
    return {
        "error": distances[worst],
        "worst": worst,
        "parallelism": str(compiled.plan.parallelism),
    }


def sweep_one(model_type: str) -> dict[str, Any]:
    """What happened to one architecture, stage by stage; stops at the first that fails."""
    import autopar
    from autopar.testing.ranks import run_ranks
    from autopar_examples.models.hf_zoo import architectures, hf_auto

    row: dict[str, Any] = {"model_type": model_type, "class": architectures()[model_type][0]}
    stage = "built"
    try:
        model, kwargs = hf_auto(model_type)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        if row["parameters"] > MAX_PARAMETERS:
            raise ValueError(f"{row['parameters']:,} parameters at the smallest config tried")
        stage = "eager"
        model(**kwargs).loss.backward()
        model.zero_grad()
        stage = "traced"
        started = time.perf_counter()
        traced = autopar.trace(model, (), kwargs)
        row["nodes"] = len(traced.graph.nodes)
        stage = "planned"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = autopar.plan(model, _mesh(), (), example_kwargs=kwargs)
        row["plan_s"] = round(time.perf_counter() - started, 1)
        said = [str(w.message) for w in caught] + list(plan.warnings)
        row["no_rule"] = sorted({op for s in said for op in NO_RULE.findall(s)})
        row["parallelism"] = str(plan.parallelism)
        stage = "equal"
        result = run_ranks(one_step, 4, (model_type,))[0]
        row["error"], row["worst"] = result["error"], result["worst"]
        row["parallelism"] = result["parallelism"]
        if not result["error"] <= 1:
            raise AssertionError(
                f"{result['worst']} off by {result['error']:.3g} times the fp32 roundoff allowed"
            )
        row["reached"] = "equal"
    except Exception as error:  # a row says what failed, whatever it was
        message = str(error).strip().splitlines()
        row["failed"] = stage
        said = message[0] if message else ""
        if len(message) > 1:  # a rank's traceback: its last line is the error
            said += " ... " + message[-1].strip()
        row["why"] = f"{type(error).__name__}: {said[:300]}"
        row["reached"] = STAGES[STAGES.index(stage) - 1] if stage != "built" else None
    return row


def _serve(connection: Connection) -> None:
    """A worker: under the memory cap, sweeps each architecture it is sent."""
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY, MEMORY))
    warnings.simplefilter("ignore")
    import transformers

    while True:
        model_type = connection.recv()
        row = sweep_one(model_type)
        row["transformers"] = transformers.__version__
        connection.send(row)


def _out_of_memory(row: dict[str, Any]) -> bool:
    why = row.get("why", "")
    return row.get("failed") == "crashed" or "allocate memory" in why or "MemoryError" in why


class Worker:
    """``sweep_one`` in a process of its own, restarted after a crash, a timeout or every
    ``ROWS_PER_WORKER`` rows (what a model leaves behind stays in its process); importing
    torch, transformers and autopar once per worker instead of once per architecture."""

    def __init__(self) -> None:
        self.process: BaseProcess | None = None
        self.connection: Connection | None = None
        self.rows = 0

    def run(self, model_type: str) -> dict[str, Any]:
        """The architecture's row; one that ran out of memory in a worker that had swept
        others is swept again in a fresh one (what those left behind counts too)."""
        row = self._run(model_type)
        if self.rows > 1 and _out_of_memory(row):
            self.stop()
            row = self._run(model_type)
        return row

    def _run(self, model_type: str) -> dict[str, Any]:
        if self.process is None or self.rows >= ROWS_PER_WORKER:
            self.stop()
            # by the module's name, also when run as __main__, so the worker's functions
            # pickle by a name the ranks it starts can import
            serve = importlib.import_module("benchmarks.coverage")._serve
            context = multiprocessing.get_context("spawn")
            self.connection, theirs = context.Pipe()
            self.process = context.Process(target=serve, args=(theirs,))
            self.process.start()
            self.rows = 0
        assert self.connection is not None
        self.rows += 1
        self.connection.send(model_type)
        try:
            if self.connection.poll(SECONDS):
                return self.connection.recv()
            failed, why = "timeout", f"over {SECONDS} s"
        except (EOFError, ConnectionError):
            code = self.process.exitcode if self.process is not None else None
            failed, why = "crashed", f"the worker died (exit code {code}: out of memory?)"
        self.stop()
        return {"model_type": model_type, "failed": failed, "why": why, "reached": None}

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
        self.process = self.connection = None


def render(rows: dict[str, dict[str, Any]], when: str) -> str:
    """docs/coverage.md from the record."""
    reached = {s: sum(1 for r in rows.values() if _at_least(r, s)) for s in STAGES}
    from autopar_examples.models.hf_zoo import architectures

    missing_rows = sorted(set(architectures()) - set(rows))
    missing: dict[str, list[str]] = {}
    for row in rows.values():
        for op in row.get("no_rule", []):
            missing.setdefault(op, []).append(row["model_type"])
    lines = [
        "# Hugging Face coverage",
        "",
        f"Every architecture of transformers {_version(rows)} with a language-model or",
        "image-classification head, built tiny from its config",
        "(random weights, no download) and taken as far as it goes: built, one eager step,",
        "traced, planned on a 2x2 CPU mesh, one compiled step on 4 gloo ranks equal to one",
        "device's (loss and every gradient within 1e-4 of the step in float64, relative to",
        "the tensor's largest value, or within the fp32 roundoff).",
        f"Measured {when} with `python -m benchmarks.coverage` (`benchmarks/coverage.py`).",
        "",
        f"Of {len(rows)} architectures: " + ", ".join(f"{reached[s]} {s}" for s in STAGES) + ".",
        *([f"Not swept yet: {', '.join(missing_rows)}."] if missing_rows else []),
        "",
        "## Ops without a sharding rule",
        "",
        "They plan replicated (every device computes the whole op), with one warning.",
        "",
    ]
    if missing:
        lines += ["| op | architectures |", "|---|---|"]
        for op, types in sorted(missing.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"| `{op}` | {len(types)}: {', '.join(sorted(types))} |")
    else:
        lines.append("None.")
    lines += [
        "",
        "## Every architecture",
        "",
        "| architecture | class | parameters | reached | ops without a rule | plan "
        "| why it stops |",
        "|---|---|---:|---|---|---|---|",
    ]
    for model_type, row in sorted(rows.items()):
        parameters = row.get("parameters")
        no_rule = ", ".join(f"`{op}`" for op in row.get("no_rule", []))
        lines.append(
            f"| {model_type} | {row.get('class', '')} "
            f"| {f'{parameters:,}' if isinstance(parameters, int) else ''} "
            f"| {row.get('reached') or '-'} | {no_rule} | {row.get('parallelism', '')} "
            f"| {_why(row)} |"
        )
    return "\n".join(lines) + "\n"


def _version(rows: dict[str, dict[str, Any]]) -> str:
    return next((r["transformers"] for r in rows.values() if "transformers" in r), "")


def _at_least(row: dict[str, Any], stage: str) -> bool:
    reached = row.get("reached")
    return reached is not None and STAGES.index(reached) >= STAGES.index(stage)


def _why(row: dict[str, Any]) -> str:
    if "failed" not in row:
        return ""
    return f"{row['failed']}: {row['why']}".replace("|", "\\|").replace("\n", " ")


def _write(path: Path, text: str) -> None:
    """Whole or not at all."""
    write_atomic(path, text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.coverage", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--only", nargs="+", default=None, metavar="MODEL_TYPE")
    parser.add_argument("--render", action="store_true", help="measure nothing")
    parser.add_argument(
        "--resume", action="store_true", help="keep the architectures already recorded"
    )
    args = parser.parse_args(argv)
    record = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": {}}
    if not args.render:
        from autopar_examples.models.hf_zoo import architectures

        types = args.only or sorted(architectures())
        if args.resume:
            types = [t for t in types if t not in record["rows"]]
        worker = Worker()
        for model_type in types:
            started = time.perf_counter()
            row = worker.run(model_type)
            row["seconds"] = round(time.perf_counter() - started, 1)
            record["rows"][model_type] = row
            print(f"{model_type}: {row.get('reached')} {_why(row)}", flush=True)
            record["when"] = datetime.date.today().isoformat()
            _write(RESULTS, json.dumps(record, indent=1, sort_keys=True) + "\n")
        worker.stop()
    _write(REPORT, render(record["rows"], record.get("when", "")))


if __name__ == "__main__":
    main()
