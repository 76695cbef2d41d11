"""How tensors are packed into buckets, one collective each: the rule the runtime follows and
the plan's ledger counts (``autopar.runtime.grad_sync``, ``autopar.runtime.zero``,
``autopar_passes.ledger``), so the two cannot count differently.

Items are ``(key, nbytes)`` in the order the runtime sees them; only items with the same key
share a bucket (the same process groups and dtype). A bucket is a list of item indices.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

MIB = 2**20
BUCKET_BYTES = 25 * MIB  # DDP's bucket_cap_mb


def ddp_buckets(
    items: Sequence[tuple[Hashable, int]],
    bucket_bytes: int = BUCKET_BYTES,
    first_bucket_bytes: int = MIB,
) -> list[list[int]]:
    """DDP's buckets: per key (in order of first appearance), items in order, a bucket
    closed once it holds ``bucket_bytes`` or more, the first of each key at
    ``first_bucket_bytes`` (so that the first all-reduce starts early in backward)."""
    by_key: dict[Hashable, list[int]] = {}
    for index, (key, _) in enumerate(items):
        by_key.setdefault(key, []).append(index)
    buckets: list[list[int]] = []
    for members in by_key.values():
        current: list[int] = []
        size, cap = 0, first_bucket_bytes
        for index in members:
            current.append(index)
            size += items[index][1]
            if size >= cap:
                buckets.append(current)
                current, size, cap = [], 0, bucket_bytes
        if current:
            buckets.append(current)
    return buckets


def open_buckets(
    items: Sequence[tuple[Hashable | None, int]], bucket_bytes: int = BUCKET_BYTES
) -> list[list[int]]:
    """ZeRO's buckets: each key keeps one open bucket, which takes an item while it stays
    within ``bucket_bytes`` (else a new one opens for the key); a ``None`` key gets a bucket
    of its own. Buckets in the order they were opened."""
    buckets: list[list[int]] = []
    open_: dict[Hashable, tuple[int, int]] = {}  # key -> (bucket index, bytes in it)
    for index, (key, size) in enumerate(items):
        if key is None:
            buckets.append([index])
            continue
        if key in open_ and open_[key][1] + size <= bucket_bytes:
            at, filled = open_[key]
            buckets[at].append(index)
            open_[key] = (at, filled + size)
            continue
        buckets.append([index])
        open_[key] = (len(buckets) - 1, size)
    return buckets
