"""What ``pip install`` puts on a user's path: autopar's own names only, every package of the
design card's folders included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_with_modules_is_a_listed_package():
    config = _setuptools()
    folders = {name: Path(folder) for name, folder in config["package-dir"].items()}
    folders["autopar"] = Path("autopar")
    found = set()
    for name, folder in folders.items():
        for module in (ROOT / folder).rglob("*.py"):
            relative = module.parent.relative_to(ROOT / folder)
            found.add(".".join((name, *relative.parts)))
    assert found == set(config["packages"])


def test_installing_autopar_adds_no_generic_top_level_names():
    """``plans``, ``passes``, ``cost_model`` and ``examples`` are common names in a user's
    own project: installed, the folders answer to ``autopar_plans`` and so on."""
    code = (
        "import importlib.util, autopar, autopar_plans, autopar_passes, autopar_cost_model, "
        "autopar_examples.models\n"
        "print([n for n in ('plans', 'passes', 'cost_model', 'examples') "
        "if importlib.util.find_spec(n) is not None])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
