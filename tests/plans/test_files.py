"""Every way a file can be wrong ends, fast, in one error naming the file (plans/files.py)."""

from __future__ import annotations

import doctest
import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import autopar_plans.files
from autopar_plans import AutoparError, HintError, PlanFileError, load_plan, load_plan_text
from autopar_plans.files import (
    HINT_FILE,
    PLAN_FILE,
    PRESET_FILE,
    FileKind,
    parse_json,
    parse_yaml,
    parse_yaml_tree,
    read_text,
)
from autopar_plans.hints import hints_from_text, load_hints

# nine levels of nine aliases: 9**10 values written out, a few hundred bytes on disk
ANCHOR_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)
)
DEEP_BRACKETS = "[" * 100_000 + "]" * 100_000
HUGE_INT = "1" * 5000
HANG_S = 30.0


def refused_quickly(call: Callable[[], object], error: type[AutoparError], match: str) -> str:
    """Run ``call``, expect ``error`` matching ``match``, and no hang (the anchor bomb and
    the 50 MB file ran for minutes before the limits; the bound is a hang's, not a
    timing: a loaded machine must not fail it); the message."""
    start = time.perf_counter()
    with pytest.raises(error, match=match) as caught:
        call()
    assert time.perf_counter() - start < HANG_S
    return str(caught.value)


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


def test_doctests() -> None:
    result = doctest.testmod(autopar_plans.files, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 5


# ---- reading ------------------------------------------------------------------------------


def test_a_50_mb_hint_file_is_refused_by_its_size_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "hints.yaml"
    with path.open("wb") as stream:
        stream.write(b"shard: {}\n" * (50 * 2**20 // 10))
    message = refused_quickly(lambda: load_hints(path), HintError, "more than a hint file")
    assert message.startswith(f"{path}: 52,428,800 bytes") and "1 MiB" in message


def test_text_over_the_cap_is_refused_without_parsing() -> None:
    text = "shard: {}\n" * (2**20 // 5)
    refused_quickly(lambda: hints_from_text(text, "h.yaml"), HintError, r"^h\.yaml: .*characters")


def test_a_pickle_renamed_json_names_the_first_bad_byte(tmp_path: Path) -> None:
    path = write(tmp_path, "plan.json", pickle.dumps({"version": 1}))
    message = refused_quickly(lambda: load_plan(path), PlanFileError, "not UTF-8 text")
    assert message.startswith(f"{path}: not UTF-8 text: byte 0x80 at offset 0")
    assert "Python pickle" in message and "autopar plan -o" in message


@pytest.mark.parametrize(
    ("data", "offset", "looks"),
    [
        (b"shard:\n  x: [tp]\n\xff\xfe\x00", 17, ""),
        (b"PK\x03\x04\x14\x00\x00\x00\x08\x00\xa0\xa1", 10, "zip archive"),
        ("shard: {}\n".encode("utf-16"), 0, "UTF-16"),
        (bytes(range(256)), 128, ""),
    ],
)
def test_binary_garbage_is_not_utf8(tmp_path: Path, data: bytes, offset: int, looks: str) -> None:
    path = write(tmp_path, "hints.yaml", data)
    message = refused_quickly(lambda: load_hints(path), HintError, "not UTF-8 text")
    assert f"at offset {offset} " in message and looks in message


def test_a_utf8_byte_order_mark_is_allowed(tmp_path: Path) -> None:
    path = write(tmp_path, "hints.yaml", b"\xef\xbb\xbfreplicate: [embed.weight]\n")
    assert load_hints(path).replicate == ("embed.weight",)


def test_a_directory_a_pipe_and_a_missing_file(tmp_path: Path) -> None:
    refused_quickly(lambda: read_text(tmp_path, PLAN_FILE), PlanFileError, "a directory, not")
    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)  # reading it would block for ever
    refused_quickly(lambda: read_text(pipe, PLAN_FILE), PlanFileError, "not a regular file")
    refused_quickly(
        lambda: read_text(tmp_path / "none.yaml", HINT_FILE), HintError, "no such hint file"
    )


# ---- parsing ------------------------------------------------------------------------------


def test_a_yaml_anchor_bomb_is_refused_while_composing() -> None:
    message = refused_quickly(
        lambda: hints_from_text(ANCHOR_BOMB, "bomb.yaml"), HintError, "alias bomb"
    )
    assert message.startswith("bomb.yaml:")


def test_a_yaml_anchor_bomb_as_a_plan_file(tmp_path: Path) -> None:
    path = write(tmp_path, "plan.yaml", ANCHOR_BOMB.replace("x, ", "[1, 2, 3, 4, 5, 6], " * 3))
    refused_quickly(lambda: load_plan(path), PlanFileError, "alias bomb")


def test_aliases_within_the_limit_are_read() -> None:
    data = parse_yaml("a: &x [tp, null]\nb: *x\nc: *x\n", "h.yaml", HINT_FILE)
    assert data == {"a": ["tp", None], "b": ["tp", None], "c": ["tp", None]}


def test_a_recursive_alias_is_refused() -> None:
    refused_quickly(
        lambda: parse_yaml("a: &x {b: *x}", "h.yaml", HINT_FILE), HintError, r"alias \*x"
    )


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_100k_nested_brackets(fmt: str) -> None:
    refused_quickly(
        lambda: load_plan_text(DEEP_BRACKETS, fmt, "p"), PlanFileError, "nested more than 64"
    )


def test_100k_nested_brackets_as_hints() -> None:
    refused_quickly(
        lambda: hints_from_text(DEEP_BRACKETS, "h.yaml"), HintError, r"^h\.yaml:1: .*nested"
    )


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        (f'{{"version": {HUGE_INT}}}', "json"),
        (f"[{HUGE_INT}]", "json"),
        (f"version: {HUGE_INT}\n", "yaml"),
        (f"version: -{HUGE_INT}\n", "yaml"),
    ],
)
def test_a_5000_digit_integer_in_a_plan(text: str, fmt: str) -> None:
    message = refused_quickly(
        lambda: load_plan_text(text, fmt, "p"), PlanFileError, "integer of 5,000 digits"
    )
    assert message.startswith("p")


def test_values_python_refuses_are_a_file_error() -> None:
    refused_quickly(
        lambda: hints_from_text("memory_limit: 2001-13-45\n", "h.yaml"), HintError, "month"
    )


def test_the_line_of_every_key_is_kept() -> None:
    data, node = parse_yaml_tree("a: 1\nb:\n  - 2\n", "h.yaml", HINT_FILE)
    assert data == {"a": 1, "b": [2]}
    assert node is not None and node.value[1][0].start_mark.line == 1


def test_a_real_plan_file_is_far_within_the_limits() -> None:
    """The caps were sized on a Llama 3 70B plan on 16x8 devices (2.8 MB, depth 5)."""
    big = {"layers": [{"name": f"layers.{i}.w", "spec": [None, "tp"]} for i in range(30_000)]}
    assert len(parse_json(json.dumps(big), "p.json", PLAN_FILE)["layers"]) == 30_000


@pytest.mark.parametrize("kind", [HINT_FILE, PLAN_FILE, PRESET_FILE])
def test_every_kind_raises_its_own_error(kind: FileKind) -> None:
    with pytest.raises(kind.error, match="not valid YAML"):
        parse_yaml("a: [", "f.yaml", kind)
    with pytest.raises(kind.error, match="not valid JSON"):
        parse_json("{", "f.json", kind)
