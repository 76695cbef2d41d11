"""A catalogue of bad files handed to the CLI's loaders: each ends in one line naming the
file and what to change, with exit code 2, quickly (``autopar.cli.main`` in-process).

Hint files go to ``autopar plan --hints``, plan files to ``autopar show``, preset files to
``autopar plan --device`` (and to ``autopar devices`` through ``$AUTOPAR_PRESET_PATH``),
model files to ``autopar plan path.py:factory``. docs/ holds the same table for users.
"""

from __future__ import annotations

import os
import pickle
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from autopar.cli import EXIT_USAGE, main

ANCHOR_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)
)
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "9" * 5000
GARBAGE = bytes(range(256)) * 16
HINTS = ["plan", "mlp-tiny", "--mesh", "2", "--hints"]
PRESET = ["plan", "mlp-tiny", "--mesh", "2", "--device"]


def sparse(size: int) -> Callable[[Path], None]:
    """A file of ``size`` zero bytes, made without writing them."""

    def make(path: Path) -> None:
        with path.open("wb") as stream:
            stream.truncate(size)

    return make


def content(data: str | bytes) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_bytes(data.encode() if isinstance(data, str) else data)

    return make


def zip_file(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"w": [0.5] * 100}))


@dataclass(frozen=True)
class Case:
    """``argv`` names ``FILE``, made by ``make`` (or left missing); stderr says ``says``."""

    id: str
    name: str
    argv: list[str]
    make: Callable[[Path], None] | None
    says: str


CASES = [
    # hint files
    Case("hint-missing", "h.yaml", [*HINTS, "FILE"], None, "no such hint file; check the path"),
    Case("hint-dir", "h.yaml", [*HINTS, "FILE"], Path.mkdir, "a directory, not a hint file"),
    Case("hint-fifo", "h.yaml", [*HINTS, "FILE"], os.mkfifo, "not a regular file"),
    Case("hint-50mb", "h.yaml", [*HINTS, "FILE"], sparse(50 * 2**20), "52,428,800 bytes, more"),
    Case("hint-binary", "h.yaml", [*HINTS, "FILE"], content(GARBAGE), "byte 0x80 at offset 128"),
    Case("hint-utf16", "h.yaml", [*HINTS, "FILE"], content("a: 1".encode("utf-16")), "UTF-16"),
    Case("hint-bomb", "h.yaml", [*HINTS, "FILE"], content(ANCHOR_BOMB), "an alias bomb?"),
    Case("hint-deep", "h.yaml", [*HINTS, "FILE"], content(DEEP), "nested more than 32 levels"),
    Case("hint-cycle", "h.yaml", [*HINTS, "FILE"], content("shard: &a {x: *a}"), "alias *a sits"),
    Case("hint-undefined", "h.yaml", [*HINTS, "FILE"], content("shard: *a"), "undefined alias"),
    Case("hint-int", "h.yaml", [*HINTS, "FILE"], content(f"pipeline: {{stages: {HUGE_INT}}}"),
         "integer of 5,000 digits"),
    Case("hint-date", "h.yaml", [*HINTS, "FILE"], content("memory_limit: 2024-13-01"),
         "timestamp '2024-13-01' cannot be read (month must be in 1..12)"),
    Case("hint-syntax", "h.yaml", [*HINTS, "FILE"], content("shard: {x: [tp]\n"),
         "not valid YAML"),
    Case("hint-list", "h.yaml", [*HINTS, "FILE"], content("- a\n- b\n"), "holds a mapping"),
    Case("hint-key", "h.yaml", [*HINTS, "FILE"], content("shards: {}\n"), "did you mean shard?"),
    # plan files
    Case("plan-missing", "p.json", ["show", "FILE"], None, "no such plan file"),
    Case("plan-dir", "p.json", ["show", "FILE"], Path.mkdir, "a directory, not a plan file"),
    Case("plan-pickle", "p.json", ["show", "FILE"], content(pickle.dumps({"version": 3})),
         "byte 0x80 at offset 0 cannot be decoded (it looks like a Python pickle)"),
    Case("plan-checkpoint", "p.json", ["show", "FILE"], zip_file,
         "(it looks like a zip archive, such as a torch checkpoint)"),
    Case("plan-int", "p.json", ["show", "FILE"], content(f'{{"version": {HUGE_INT}}}'),
         "integer of 5,000 digits"),
    Case("plan-int-yaml", "p.yaml", ["show", "FILE"], content(f"version: {HUGE_INT}"),
         "integer of 5,000 digits"),
    Case("plan-deep", "p.json", ["show", "FILE"], content(DEEP), "nested more than 64 levels"),
    Case("plan-deep-yaml", "p.yaml", ["show", "FILE"], content(DEEP), "nested more than 64"),
    Case("plan-bomb", "p.yaml", ["show", "FILE"],
         content(ANCHOR_BOMB.replace("x, ", "[x, x, x, x, x, x, x, x], ")), "an alias bomb?"),
    Case("plan-200mb", "p.json", ["show", "FILE"], sparse(200 * 2**20),
         "more than a plan file may have (128 MiB)"),
    Case("plan-empty", "p.json", ["show", "FILE"], content(""), "not valid JSON"),
    Case("plan-list", "p.json", ["show", "FILE"], content("[1, 2]"), "holds a mapping"),
    Case("plan-version", "p.json", ["show", "FILE"], content('{"version": 0}'),
         "re-plan the model"),
    # preset files
    Case("preset-missing", "d.yaml", [*PRESET, "FILE"], None, "no such preset file"),
    Case("preset-binary", "d.yaml", [*PRESET, "FILE"], content(GARBAGE), "not UTF-8 text"),
    Case("preset-5mb", "d.yaml", [*PRESET, "FILE"], sparse(5 * 2**20),
         "more than a preset file may have (1 MiB)"),
    Case("preset-bomb", "d.yaml", [*PRESET, "FILE"], content(ANCHOR_BOMB), "an alias bomb?"),
    Case("preset-deep", "d.yaml", [*PRESET, "FILE"], content(DEEP), "nested more than 32"),
    Case("preset-int", "d.yaml", [*PRESET, "FILE"], content(f"memory_bytes: {HUGE_INT}"),
         "integer of 5,000 digits"),
    Case("preset-list", "d.yaml", [*PRESET, "FILE"], content("[a100]"), "holds a mapping"),
    # model files
    Case("model-missing", "m.py", ["plan", "FILE:build", "--mesh", "2"], None, "no such file"),
    Case("model-pickle", "m.py", ["plan", "FILE:build", "--mesh", "2"],
         content(pickle.dumps([1, 2])), "not UTF-8 text: byte 0x80 at offset 0"),
    Case("model-latin1", "m.py", ["plan", "FILE:build", "--mesh", "2"],
         content(b"def build():\n    return 'caf\xe9'\n"), "byte 0xe9 at offset 28"),
    Case("model-20mb", "m.py", ["plan", "FILE:build", "--mesh", "2"], sparse(20 * 2**20),
         "more than a model file may have (16 MiB)"),
    Case("model-coding", "m.py", ["plan", "FILE:build", "--mesh", "2"],
         content("# coding: klingon\n"), "unknown encoding: klingon"),
    Case("model-exit", "m.py", ["plan", "FILE:build", "--mesh", "2"],
         content("import sys\nsys.exit(3)\n"), "failed: SystemExit: 3"),
    Case("model-nulls", "m.py", ["plan", "FILE:build", "--mesh", "2"],
         content(b"x = 1\0\n"), "failed: SyntaxError"),
    Case("model-relative", "m.py", ["plan", ".:build", "--mesh", "2"], None,
         "cannot import module '.'"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_file(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / case.name
    if case.make is not None:
        case.make(path)
    argv = [arg.replace("FILE", case.name) for arg in case.argv]
    start = time.perf_counter()
    code = main(argv)
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE, err
    assert err.startswith(f"autopar {argv[0]}: error: ") and err.count("\n") == 1, err
    assert case.says in err
    if "FILE" in "".join(case.argv):
        assert case.name in err  # the message names the file
    assert out == ""
    assert elapsed < 30.0  # no hang (a bound for a hang, not a timing: load must not fail it)


def test_a_bad_preset_on_the_search_path_stops_autopar_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mine.yaml").write_text(ANCHOR_BOMB)
    monkeypatch.setenv("AUTOPAR_PRESET_PATH", str(tmp_path))
    assert main(["devices"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"autopar devices: error: {tmp_path / 'mine.yaml'}:") and "bomb" in err


def test_the_catalogue_is_long_enough() -> None:
    assert len(CASES) >= 40
