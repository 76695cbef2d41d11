"""The ``autopar`` command through a subprocess, as a user runs it."""

import subprocess
import sys

from autopar import __version__


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autopar", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_version():
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"autopar {__version__}"


def test_help_lists_commands_and_exit_codes():
    result = run("--help")
    assert result.returncode == 0
    for command in ("demo", "devices", "calibrate"):
        assert command in result.stdout
    assert "3 infeasible" in result.stdout


def test_no_command_is_a_usage_error():
    assert run().returncode == 2


def test_demo_trace_summarises_a_models_graph():
    result = run("demo", "--trace", "--model", "gpt-tiny")
    assert result.returncode == 0, result.stderr
    assert "layers found" in result.stdout
    assert "2 under 'layers'" in result.stdout
    assert "aten.linear.default" in result.stdout


def test_unknown_model_is_one_clear_message():
    result = run("demo", "--model", "gpt2-124n")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "did you mean gpt2-124m" in result.stderr.lower()


def test_untraceable_model_exits_4_naming_the_line(tmp_path):
    source = tmp_path / "bad_model.py"
    source.write_text(
        "import torch\n"
        "class Bad(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        if x.sum() > 0:\n"
        "            return x * 2\n"
        "        return x\n"
        "def factory():\n"
        "    return Bad(), (torch.randn(2, 3),)\n"
    )
    result = run("demo", "--model", f"{source}:factory")
    assert result.returncode == 4
    assert "bad_model.py:4" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_report_without_matplotlib_fails_before_planning(monkeypatch, capsys, tmp_path):
    """Where matplotlib is missing (a partial install), the report could only fail after the
    plan was made; the command says so first, with the fix, and plans nothing."""
    import importlib.util

    import autopar
    from autopar.cli import main

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "matplotlib" else real_find_spec(name, *args)

    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned before checking for matplotlib")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(autopar, "plan", no_planning)
    code = main(["plan", "gpt-tiny", "--mesh", "2", "--report", str(tmp_path / "r.html")])
    assert code == 2
    error = capsys.readouterr().err
    assert "--report draws with matplotlib" in error and "pip install matplotlib" in error
    assert not (tmp_path / "r.html").exists()
