"""Bucketing rules the runtime follows and the ledger counts (``autopar_plans.buckets``)."""

from __future__ import annotations

from autopar_plans.buckets import MIB, ddp_buckets, open_buckets


def test_ddp_closes_the_first_bucket_at_one_mib_and_the_rest_at_25():
    sizes = [int(s * MIB) for s in (0.5, 0.5, 0.5, 10, 10, 10)]
    assert ddp_buckets([("g", s) for s in sizes]) == [[0, 1], [2, 3, 4, 5]]


def test_ddp_buckets_hold_one_key_each_in_order_of_first_appearance():
    items = [("a", 10), ("b", 10), ("a", 10)]
    assert ddp_buckets(items, bucket_bytes=100, first_bucket_bytes=100) == [[0, 2], [1]]


def test_zero_buckets_open_anew_when_full_and_put_uneven_items_alone():
    items = [("k", 60), ("k", 30), (None, 5), ("k", 20), ("k", 1)]
    assert open_buckets(items, bucket_bytes=100) == [[0, 1], [2], [3, 4]]
