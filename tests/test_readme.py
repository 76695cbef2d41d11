"""The README's example runs as written (as a script, the way a user would copy it)."""

import runpy
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(tmp_path):
    text = README.read_text()
    code = text.split("```python", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=README.parent,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("dp=")  # the parallelism summary
    assert "s/step, MFU" in lines[1]
    losses = eval(lines[2])
    assert len(losses) == 2 and losses[0] == losses[1]


def test_the_readme_sample_output_is_what_the_command_prints_now():
    """The README's plan output is made by ``docs/readme_sample.py`` from the current code:
    a change to the planner that changes it fails here until the script is run again."""
    sample = runpy.run_path(str(README.parent / "docs" / "readme_sample.py"))
    block = sample["render"]()
    assert block.startswith("llama3-8b on node=2 x gpu=8")
    assert "memory per device" in block and "pipeline stages" in block
    assert not sample["stale"](README.read_text(), block), "run python docs/readme_sample.py"
