"""The README's example runs as written and prints what its comments say."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs_and_its_comments_are_true():
    text = README.read_text()
    code = text.split("```python", 1)[1].split("```", 1)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    printed = out.getvalue().splitlines()
    claims = [m.group(1).strip() for m in re.finditer(r"print\(.*\)[ \t]+# (.*)", code)]
    assert len(printed) >= len(claims)
    literal = [c for c in claims if not c.startswith("forward")]
    for claim in literal:
        assert claim in printed, f"README claims {claim!r}; the example printed {printed}"
    assert 1855425871872 == 2 * 2048 * 12288 * 36864  # the qkv GEMM: 2 m n k
