"""The ledger's terms (``autopar_plans.ledger``): bytes a call sends, and tallies by key."""

from __future__ import annotations

import pytest

from autopar_plans.ledger import CommEntry, sent, tally, tally_entries


@pytest.mark.parametrize(
    ("kind", "factor"),
    [
        ("all_reduce", 2 * 3 / 4),
        ("all_gather", 3 / 4),
        ("reduce_scatter", 3 / 4),
        ("all_to_all", 3 / 4),
        ("broadcast", 1),
    ],
)
def test_a_device_sends_the_ring_share_of_the_payload(kind: str, factor: float):
    # an all-to-all's payload is each device's buffer, of which it sends n - 1 pieces of n
    assert sent(kind, 1000.0, 4) == pytest.approx(factor * 1000.0)
    assert sent(kind, 1000.0, 1) == 0.0


def test_tallies_add_calls_and_bytes_per_kind_axes_and_dtype():
    rows = [
        ("all_reduce", ("dp",), "float32", 1, 100.0),
        ("all_reduce", ("dp",), "float32", 2, 50.0),
        ("all_reduce", ("tp",), "float32", 1, 8.0),
        ("all_gather", ("dp",), "bfloat16", 0, 0.0),  # no calls: no key
    ]
    assert tally(rows) == {
        ("all_reduce", ("dp",), "float32"): (3, 150.0),
        ("all_reduce", ("tp",), "float32"): (1, 8.0),
    }


def test_an_entry_counts_its_bytes_once_per_call():
    entry = CommEntry(
        kind="reduce_scatter",
        axes=("dp",),
        dtype="bfloat16",
        bytes_per_call=64.0,
        calls_per_step=4,
        phase="backward",
        what="ZeRO-2 bucket 0",
    )
    assert tally_entries([entry]) == {("reduce_scatter", ("dp",), "bfloat16"): (4, 256.0)}
