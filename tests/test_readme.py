"""The README's example runs as written (as a script, the way a user would copy it)."""

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
