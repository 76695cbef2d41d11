"""Counting the ``torch.distributed`` collectives a rank calls (for tests that specify how
many a step makes)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

COUNTED = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "reduce_scatter_tensor",
    "all_to_all",
    "broadcast",
)


@contextmanager
def counting(counts: Counter[str]) -> Iterator[None]:
    """Count the ``torch.distributed`` collectives called inside (by their name)."""
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counted(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return call(*args, **kwargs)

        return wrapper

    for name, call in originals.items():
        setattr(dist, name, counted(name, call))
    try:
        yield
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)
