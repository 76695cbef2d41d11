"""Python's cyclic garbage collector, held off while planning allocates.

Planning makes millions of small containers (strategies, the ILP's terms, the rows of each
solve) over a heap that holds the model's traces. CPython's collector runs a young
collection every 700 allocations and, once enough objects have survived them, a full
collection, which walks every object alive: the traces' graphs and fake tensors
included, 0.4-0.8 s each with llama3-8b's traces at four batch sizes. Its planning on 64
H100s made 21 full collections and 1,071 middle ones, 7-10 s of a 32-s search, to
reclaim objects refcounting mostly frees on its own.

``collector_paused`` holds the automatic collector off for a block (a trace, a solve, the
pipeline search) and at its end collects the young generations once: the cycles the
block left (9,000-53,000 objects a solve), found among the objects made since the last
collection, without walking the traces again. Memory stays as with the collector on
(llama3-8b on 64 H100s: 867 MB against 881 MB at the peak). torch's
``distributed.checkpoint.state_dict`` holds the collector off the same way while it
builds state dicts.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block; the young generations collected at its
    end; the collector left as it was (on, or off where the caller turned it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(1)
        if enabled:
            gc.enable()
