"""The README's sample output, made by the current code: ``python docs/readme_sample.py``
rewrites the block under the README's ``$ autopar plan ...`` line with what that command
prints now; ``--check`` only says whether the block is stale (exit 1), as the test does.

The README shows the plan's summary, its memory per device and its pipeline stages; the
other tables (where the step time goes, every parameter's layout) are left out, as it says.
The solver's time differs from run to run, so the check reads it as any number.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from autopar_plans.writes import write_atomic

README = Path(__file__).resolve().parents[1] / "README.md"
COMMAND = "plan llama3-8b --cluster 2x8 --device h100-sxm --global-batch 64 --precision bf16_mixed"
SHOWN = ("llama3-8b on ", "memory per device", "pipeline stages")  # the tables kept
WIDTH = "100"  # rich's width, so that the block reads the same on every terminal
SOLVER_TIME = re.compile(r"(optimal in )[\d.]+( s)")


def render() -> str:
    """What the command prints now, trimmed to the tables the README shows."""
    done = subprocess.run(
        [sys.executable, "-m", "autopar", *COMMAND.split()],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": WIDTH},
    )
    kept: list[str] = []
    showing = False
    for line in done.stdout.splitlines():
        if line[:1].isalpha():  # a table's title, at the left margin
            showing = line.startswith(SHOWN)
        if showing:
            kept.append(line.rstrip())
    return "\n".join(kept) + "\n"


def splice(readme: str, block: str) -> str:
    """``readme`` with the lines between the command and the block's end replaced."""
    prompt = f"$ autopar {COMMAND}\n"
    start = readme.index(prompt) + len(prompt)
    end = readme.index("```", start)
    return readme[:start] + block + readme[end:]


def stale(readme: str, block: str) -> bool:
    """Whether the README's block differs from ``block`` (the solver's time aside)."""
    return SOLVER_TIME.sub(r"\1N\2", splice(readme, block)) != SOLVER_TIME.sub(r"\1N\2", readme)


def main(argv: list[str]) -> int:
    readme = README.read_text()
    block = render()
    if "--check" in argv:
        if stale(readme, block):
            print(f"{README.name}: the sample output is stale: run {Path(__file__).name}")
            return 1
        return 0
    write_atomic(README, splice(readme, block))  # whole or not at all
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
