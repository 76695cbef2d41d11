"""The pipeline search's figure for the configuration it chose, against that plan's ledger
step, under FSDP with prefetched gathers.

    python -m benchmarks.search_ledger

gpt-tiny of 6 layers on devices that compute at CPU speed on an H100's link (layers
compute longer than their gathers), compute hiding ``comm_overlap`` of what runs beside
it; FSDP forced, the stages, microbatches and schedule fixed. One line a configuration:
the search's step (``Candidate.step_time_s``, from ``layer_costs``), the plan's (the
ledger's) and their ratio. The search ranks configurations by the first; a plan promises
the second.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import autopar
from autopar.testing.meshes import fast_link_mesh
from autopar_examples.models import build
from autopar_passes.pipeline import search

CONFIGS = ((1, 2, None, 8), (2, 4, "1f1b", 8), (2, 4, "gpipe", 8), (3, 4, "1f1b", 12))


def main() -> None:
    chosen: dict[str, float] = {}
    to_plan = search._to_plan

    def recording(request: Any, best: Any, others: Any) -> Any:
        chosen["step"] = best.step_time_s
        return to_plan(request, best, others)

    search._to_plan = recording  # the chosen candidate's own figure, before the ledger
    with tempfile.TemporaryDirectory() as folder:
        for overlap in (1.0, 0.5):
            for stages, microbatches, schedule, devices in CONFIGS:
                model, (tokens,) = build("gpt-tiny", device="meta", batch_size=64, n_layer=6)
                options: dict[str, Any] = {"stages": stages, "microbatches": microbatches}
                if schedule:
                    options["schedule"] = schedule
                mesh = fast_link_mesh(Path(folder), overlap, devices)
                plan = autopar.plan(model, mesh, (tokens,), force="fsdp", **options)
                ledger = plan.estimate.step_time_s
                print(
                    f"overlap {overlap:g}, {stages} stages, {microbatches} microbatches, "
                    f"{schedule or 'no pipeline'}: search {chosen['step'] * 1e3:.3f} ms, "
                    f"ledger {ledger * 1e3:.3f} ms, {chosen['step'] / ledger:.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
