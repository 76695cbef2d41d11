"""Property: any text or bytes handed to the hint, plan and preset loaders ends, within a
second, in a value or one ``AutoparError`` (issue 24): never another exception or a hang.

Inputs are built from the pieces that break parsers (brackets, anchors and aliases, tags,
long integers, dates, control characters) and from real files with a value replaced.
Derandomized, so a run is repeatable; the examples are few enough to stay in seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar_cost_model.hardware import load_preset
from autopar_plans import AutoparError, load_plan, load_plan_text
from autopar_plans.files import HINT_FILE, PLAN_FILE, parse_json, parse_yaml
from autopar_plans.hints import hints_from_text, load_hints

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

YAML_PIECES = [
    *("shard", "replicate", "pipeline", "mesh", "ban", "memory_limit", "cuts", "stages"),
    *("name", "memory_bytes", "gpus_per_node", "intra_node", "bandwidth", "version"),
    *(":", ": ", " ", "\n", "  ", "- ", "[", "]", "{", "}", ",", "?", "#", '"', "'", "|"),
    *("&a ", "*a", "&b ", "*b", "<<: ", "!!int ", "!!str ", "!!binary ", "!!python/tuple "),
    *("!!float ", "!!map ", "!!set ", "!!timestamp ", "---\n", "...\n", "%YAML 1.1\n"),
    *("tp", "dp", "null", "~", "true", "60GiB", "1f1b", "0x1F", "0o17", "1_000", "190:20:30"),
    *("1e999", ".nan", "-.inf", "2024-13-01", "2024-02-30 25:61:00", "9" * 5000, "9" * 101),
    *("\t", "\x00", "\ufeff", "\x85", "\u2028", "\ud800", "\\u0000", "\\", "%", "@", "`"),
]
JSON_PIECES = [
    *("{", "}", "[", "]", ",", ":", '"version"', '"mesh"', '"a"', '""', " ", "\n"),
    *("0", "3", "-1", "1.5", "1e400", "-0", "NaN", "Infinity", "null", "true", "false"),
    *('"\\ud800"', '"\\u0000"', '"\\x"', "9" * 5000, "9" * 101, "\x00", "\ufeff"),
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from([10**200, -(10**120), "[tp, null]", "60GiB", "*"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def pieces(alphabet: list[str]) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(alphabet) | st.text(max_size=4), max_size=40).map("".join)


def as_bytes(text: str) -> bytes:
    """``text`` as UTF-8, a lone surrogate (``\\ud800``) kept as the bytes that are not UTF-8."""
    return text.encode("utf-8", "surrogatepass")


def ends_well(call: Callable[[], Any]) -> None:
    """``call`` returns or raises ``AutoparError``, and does not hang (a bound for a hang,
    not a timing: a loaded machine must not fail it)."""
    start = time.perf_counter()
    with contextlib.suppress(AutoparError):
        call()
    assert time.perf_counter() - start < 30.0


def replaced(data: Any, path: list[int], value: Any) -> Any:
    """``data`` with the value at a path (indices taken modulo each level's size) replaced."""
    if not path or not isinstance(data, dict | list) or not data:
        return value
    keys = list(data) if isinstance(data, dict) else list(range(len(data)))
    key = keys[path[0] % len(keys)]
    copy = dict(data) if isinstance(data, dict) else list(data)
    copy[key] = replaced(data[key], path[1:], value)
    return copy


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def plan_data() -> Iterator[dict[str, Any]]:
    """A real plan's fields (a small MLP on two devices)."""
    import autopar
    from autopar_examples.models import build

    model, inputs = build("mlp-tiny")
    yield autopar.plan(model, autopar.Mesh((2,), ("dp",)), inputs).model_dump(mode="json")


def unique_file(folder: Path, data: bytes, suffix: str) -> Path:
    """A file per content: loaders cache by path and modification time."""
    path = folder / f"{hashlib.sha1(data).hexdigest()}{suffix}"
    path.write_bytes(data)
    return path


@FUZZ
@given(pieces(YAML_PIECES))
def test_hint_text(text: str) -> None:
    ends_well(lambda: hints_from_text(text, "h.yaml"))


@FUZZ
@given(st.dictionaries(st.sampled_from(YAML_PIECES[:8]), json_values, max_size=4))
def test_hint_fields(fields: dict[str, Any]) -> None:
    ends_well(lambda: hints_from_text(yaml.safe_dump(fields), "h.yaml"))


@FUZZ
@given(st.binary(max_size=200) | pieces(YAML_PIECES).map(as_bytes))
def test_hint_and_plan_files_of_any_bytes(folder: Path, data: bytes) -> None:
    ends_well(lambda: load_hints(unique_file(folder, data, ".yaml")))
    ends_well(lambda: load_plan(unique_file(folder, data, ".json")))


@FUZZ
@given(pieces(JSON_PIECES), st.sampled_from(["json", "yaml"]))
def test_plan_text(text: str, fmt: str) -> None:
    ends_well(lambda: load_plan_text(text, fmt, "p"))  # type: ignore[arg-type]


@FUZZ
@given(st.lists(st.integers(0, 50), max_size=5), json_values, st.sampled_from(["json", "yaml"]))
def test_a_real_plan_with_a_value_replaced(
    plan_data: dict[str, Any], path: list[int], value: Any, fmt: str
) -> None:
    data = replaced(plan_data, path, value)
    text = json.dumps(data) if fmt == "json" else yaml.safe_dump(data)
    ends_well(lambda: load_plan_text(text, fmt, "p"))  # type: ignore[arg-type]


@FUZZ
@given(st.lists(st.integers(0, 50), max_size=3), json_values)
def test_a_real_preset_with_a_value_replaced(folder: Path, path: list[int], value: Any) -> None:
    data = replaced(load_preset("h100-sxm").model_dump(mode="json"), path, value)
    text = yaml.safe_dump(data).encode()
    ends_well(lambda: load_preset(unique_file(folder, text, ".yaml")))


@FUZZ
@given(st.binary(max_size=200) | pieces(YAML_PIECES).map(as_bytes))
def test_preset_files_of_any_bytes(folder: Path, data: bytes) -> None:
    ends_well(lambda: load_preset(unique_file(folder, data, ".yaml")))


@FUZZ
@given(pieces(YAML_PIECES + JSON_PIECES))
def test_the_parsers_alone(text: str) -> None:
    ends_well(lambda: parse_yaml(text, "f", HINT_FILE))
    ends_well(lambda: parse_json(text, "f", PLAN_FILE))
