"""The plan's ledger (``passes.ledger``): the step's collectives, and the estimate summed
over them. (That the runtime issues exactly these is ``tests/autopar/runtime/test_ledger``.)"""

from __future__ import annotations

import pytest

import autopar
from examples.models import build
from plans.ledger import CommEntry
from plans.plan import Plan


def _plan(batch: int = 4, mesh_shape: tuple[int, ...] = (2, 2), **options) -> Plan:
    model, (tokens,) = build("gpt-tiny", device="meta", batch_size=batch)
    mesh = autopar.Mesh(mesh_shape, ("dp", "tp")[: len(mesh_shape)], device="h100-sxm")
    return autopar.plan(model, mesh, (tokens,), stages=1, **options)


def _where(plan: Plan, text: str) -> list[CommEntry]:
    return [e for e in plan.estimate.comm if text in e.what]


@pytest.fixture(scope="module")
def dp() -> Plan:
    return _plan(force="dp", global_batch=16, microbatches=4)


def test_the_estimate_is_a_sum_over_the_ledger(dp: Plan):
    e = dp.estimate
    assert e.comm
    assert e.comm_bytes_per_step == pytest.approx(sum(c.sent_per_step for c in e.comm))
    assert e.comm_s == pytest.approx(sum(c.time_s for c in e.comm))
    assert e.exposed_comm_s == pytest.approx(sum(c.exposed_s for c in e.comm))
    assert sum(e.comm_bytes_by_kind.values()) == pytest.approx(e.comm_bytes_per_step)
    assert e.step_time_s == pytest.approx(e.compute_s + e.bubble_s + e.exposed_comm_s)


def test_gradient_sync_runs_once_per_step_and_reshards_every_microbatch(dp: Plan):
    sync = _where(dp, "gradient sync")
    assert sync and all(s.calls_per_step == 1 and s.overlap == "backward" for s in sync)
    # data parallel over both axes: each bucket all-reduced over dp, then over tp
    assert {s.axes for s in sync} == {("dp",), ("tp",)}
    reshards = _where(dp, "reshard")
    assert reshards and all(r.calls_per_step == 4 for r in reshards)
    assert all(r.overlap == "none" and r.exposed_s == r.time_s for r in reshards)


def test_zero2_sums_every_microbatch_and_zero1_once():
    for zero, calls in ((1, 1), (2, 4)):
        plan = _plan(force="dp", zero=zero, global_batch=16, microbatches=4)
        sums = [e for e in _where(plan, f"ZeRO-{zero}") if e.phase == "backward"]
        assert sums and all(s.calls_per_step == calls for s in sums)
        masters = [e for e in _where(plan, f"ZeRO-{zero}") if e.phase == "step"]
        assert {m.kind for m in masters} == {"all_gather"}
        assert all(m.calls_per_step == 1 for m in masters)


def test_parameter_gathers_do_not_grow_with_the_traced_batch():
    """The same FSDP step (microbatches of 2) traced at batch 8 or at batch 2: the weights
    gathered are the same bytes; only the activations' reshards are scaled."""

    def gathered(plan: Plan) -> float:
        return sum(e.bytes_per_call * e.calls_per_step for e in _where(plan, "FSDP gather"))

    options = {"mesh_shape": (2,), "force": "fsdp", "global_batch": 8, "microbatches": 4}
    traced_big = _plan(batch=8, **options)
    traced_small = _plan(batch=2, **options)
    assert traced_big.microbatch_size == traced_small.microbatch_size == 2
    assert gathered(traced_big) == gathered(traced_small) > 0
