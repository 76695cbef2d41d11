"""Python's cyclic collector is held off while planning allocates, and what the block leaves
in cycles is collected at its end."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

import autopar
from autopar_examples.models import build
from autopar_passes import solve as solve_pass
from autopar_passes import trace as trace_pass
from autopar_passes.collector import collector_paused


@pytest.fixture
def collector_on() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.enable()
    yield
    if not enabled:
        gc.disable()


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    """A cycle no name holds: only the cyclic collector frees it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_no_automatic_collection_inside_and_the_cycles_made_there_collected_at_its_end(
    collector_on: None,
) -> None:
    with collector_paused():
        assert not gc.isenabled()
        cycle = _cycle()
        survivors = [_cycle() for _ in range(10_000)]  # past any automatic threshold
        assert cycle() is not None
        assert all(ref() is not None for ref in survivors)
    assert gc.isenabled()
    assert cycle() is None
    assert all(ref() is None for ref in survivors)


def test_nested_blocks_leave_the_collector_off_until_the_outer_one_ends(collector_on: None) -> None:
    with collector_paused():
        with collector_paused():
            inner = _cycle()
        assert inner() is None  # the inner block's end collected it
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collector_on: None) -> None:
    gc.disable()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("the block's own error passes through")
    assert not gc.isenabled()


def test_trace_and_solve_run_with_the_collector_held_off(
    collector_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, bool] = {}
    export, solve = trace_pass._export, solve_pass._solve

    def spy_export(*args, **kwargs):
        seen["export"] = gc.isenabled()
        return export(*args, **kwargs)

    def spy_solve(*args, **kwargs):
        seen["solve"] = gc.isenabled()
        return solve(*args, **kwargs)

    monkeypatch.setattr(trace_pass, "_export", spy_export)
    monkeypatch.setattr(solve_pass, "_solve", spy_solve)
    model, inputs = build("mlp-tiny", batch_size=8)
    autopar.plan(model, autopar.Mesh((2,), ("dp",), device="h100-sxm"), inputs)
    assert seen == {"export": False, "solve": False}
    assert gc.isenabled()
