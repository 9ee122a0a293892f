"""Which instances hold each block, across every instance's prefix index (an inverted index, kept
in step by the indexes themselves: PrefixIndex.attach): routing a prompt weighs the instances
holding its deepest blocks, not every instance (docs/proxy.md "Routing")."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Container, Sequence


class Holders:
    def __init__(self) -> None:
        # block key -> the one owner holding it, or the owners when several (most keys have one:
        # a str costs less than a set per key)
        self._of: dict[bytes, str | set[str]] = {}
        self._size: dict[str, int] = {}  # owner -> its index's block size
        self._sizes: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._of)

    def add(self, key: bytes, owner: str) -> None:
        cur = self._of.get(key)
        if cur is None:
            self._of[key] = owner
        elif isinstance(cur, str):
            if cur != owner:
                self._of[key] = {cur, owner}
        else:
            cur.add(owner)

    def drop(self, key: bytes, owner: str) -> None:
        cur = self._of.get(key)
        if cur is None:
            return
        if isinstance(cur, str):
            if cur == owner:
                del self._of[key]
            return
        cur.discard(owner)
        if len(cur) == 1:
            self._of[key] = next(iter(cur))

    def of(self, key: bytes) -> tuple[str, ...]:
        """The owners holding `key` (in any medium)."""
        cur = self._of.get(key)
        if cur is None:
            return ()
        return (cur,) if isinstance(cur, str) else tuple(cur)

    def deepest(self, keys: Sequence[bytes], want: int, among: Container[str]) -> list[str]:
        """Up to `want` owners of `among` (one role's) holding the longest runs of `keys`, deepest
        first (a level with more than still wanted gives a random few: none is always left out).

        Levels are read at depths deepest, deepest - 1, - 2, - 4, ...: an owner holding a run of
        blocks appears at every level above its run's end, so it is found at the next level read
        (at most twice as shallow), in O(log depth) levels rather than all of them."""
        if want <= 0:
            return []
        levels: list[str | set[str]] = []
        for k in keys:
            cur = self._of.get(k)
            if cur is None:
                break
            levels.append(cur)
        out: dict[str, None] = {}
        depths, d, step = [], len(levels) - 1, 1
        while d > 0:
            depths.append(d)
            d, step = d - step, step * 2
        if levels:
            depths.append(0)
        for cur in (levels[d] for d in depths):
            if isinstance(cur, str):
                if cur in among:
                    out[cur] = None
            else:
                fresh = [o for o in cur if o in among and o not in out]
                room = want - len(out)
                for o in fresh if len(fresh) <= room else random.sample(fresh, room):
                    out[o] = None
            if len(out) >= want:
                break
        return list(out)

    def sized(self, owner: str, block_size: int | None) -> None:
        """`owner`'s index now keys blocks of `block_size` tokens (None: it left)."""
        old = self._size.pop(owner, None)
        if old is not None:
            self._sizes[old] -= 1
            if not self._sizes[old]:
                del self._sizes[old]
        if block_size is not None:
            self._size[owner] = block_size
            self._sizes[block_size] += 1

    def block_sizes(self) -> list[int]:
        """The block sizes some index uses (one, in a cluster of one model)."""
        return list(self._sizes)
