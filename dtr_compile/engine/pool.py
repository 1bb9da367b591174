"""The set of eviction candidates, with O(1) insertion, removal and uniform sampling."""

from __future__ import annotations

import random
from collections.abc import Iterator

from .records import Storage


class CandidatePool:
    """Resident, unpinned, recomputable storages. Each storage remembers its slot (`pool_index`)."""

    def __init__(self) -> None:
        self._items: list[Storage] = []
        self.nbytes = 0  # their total size: what evicting every candidate could free

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Storage]:
        return iter(self._items)

    def add(self, storage: Storage) -> None:
        if storage.pool_index >= 0:
            return
        storage.pool_index = len(self._items)
        self._items.append(storage)
        self.nbytes += storage.nbytes

    def discard(self, storage: Storage) -> None:
        """Remove by swapping the last item into the freed slot."""
        index = storage.pool_index
        if index < 0:
            return
        last = self._items.pop()
        if last is not storage:
            self._items[index] = last
            last.pool_index = index
        storage.pool_index = -1
        self.nbytes -= storage.nbytes

    def sample(self, k: int, rng: random.Random) -> list[Storage]:
        if k >= len(self._items):
            return list(self._items)
        return rng.sample(self._items, k)
