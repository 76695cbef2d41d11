"""Counting the bytes of live tensor storage, as a GPU allocator would (for tests that
compare the memory of two training steps on CPU, where no allocator keeps statistics)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.runtime.shards import local_of


class LiveBytes(TorchDispatchMode):
    """The bytes of every storage made by an op inside, and of the tensors ``track``ed,
    while they live: ``current`` now, ``peak`` the most at once."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> None:
        # a DTensor (a compiled model's parameter, its gradient and optimizer state) holds
        # its local shard's storage, and no storage of its own
        storage = local_of(tensor).untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out
