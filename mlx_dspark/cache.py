"""A sliding-window KV cache that can roll back rejected draft tokens.

mlx-lm's ``RotatingKVCache`` overwrites its oldest entries in place and stops
being trimmable once it has wrapped, so after the first window of context a
rejected draft stays in the cache and speculative decoding silently changes
the output. ``SlidingWindowKVCache`` keeps ``window - 1 + max_rollback``
entries in a ring, the token at position ``p`` in slot ``p mod capacity``,
and builds its attention mask from the slots' positions. Positions are always
written in order, so the slots hold exactly the positions
``[end - capacity, end)``, ``end`` being the highest position ever written
plus one. Rolling back only moves ``offset`` back: the entries it leaves
behind have positions at or beyond ``offset``, so the causal mask hides them
until they are overwritten by the same positions.
"""

import math
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import RotatingKVCache, _BaseCache


def rollback_depth(cache) -> float:
    """How many of its newest tokens ``cache`` can drop after any write: what
    a verify may add at most (drafts plus one). Unbounded for a cache that
    keeps all it holds, 0 for one that may overwrite what a rollback needs
    (mlx-lm's ``RotatingKVCache`` once its window has filled) or that cannot
    be trimmed."""
    if hasattr(cache, "rollback_depth"):
        return cache.rollback_depth()
    if isinstance(cache, RotatingKVCache) or not cache.is_trimmable():
        return 0
    return math.inf


def rollback_limit(cache) -> int:
    """How many of its newest tokens ``cache`` can drop right now."""
    if hasattr(cache, "rollback_limit"):
        return cache.rollback_limit()
    return cache.offset if cache.is_trimmable() else 0


def check_window(window: Optional[int], asked: Optional[int]) -> None:
    """A layer's mask request matches the window the cache serves."""
    if asked is not None and asked != window:
        raise ValueError(
            f"This cache serves a window of {window} tokens, but the layer "
            f"asked for a mask with window {asked}."
        )


def visible(keys: mx.array, queries: mx.array, window: Optional[int]) -> mx.array:
    """Which key positions each query position attends to: written ones
    (``>= 0``), not in its future, and within ``window`` if there is one."""
    mask = (keys >= 0) & (keys <= queries)
    if window is not None:
        mask = mask & (keys > queries - window)
    return mask


class SlidingWindowKVCache(_BaseCache):
    """KV cache for a sliding-window attention layer, with bounded rollback.

    The ring grows in steps of 256 slots up to its capacity, so short contexts
    use little memory.

    Args:
        window: The layer's attention window: the query at position ``p`` sees
            the keys at positions ``p - window < q <= p``.
        max_rollback: Forwards of up to this many tokens are written in place,
            and the newest ``max_rollback`` tokens can always be trimmed.
            Longer forwards (prompt chunks) are correct too, at the cost of a
            concatenation.
    """

    step = 256

    def __init__(self, window: int, max_rollback: int):
        if window < 1 or max_rollback < 1:
            raise ValueError(
                f"window ({window}) and max_rollback ({max_rollback}) must be >= 1"
            )
        self.window = window
        self.max_rollback = max_rollback
        self.keys = None
        self.values = None
        self.offset = 0
        self._end = 0  # highest position ever written, plus one
        self._start = 0  # oldest position whose entry is still in the ring

    @property
    def capacity(self) -> int:
        return self.window - 1 + self.max_rollback

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def slot_positions(self, end: Optional[int] = None) -> mx.array:
        """The position held by each slot (negative: never written), when the
        highest position written is ``end - 1``."""
        end = self._end if end is None else end
        slot = mx.arange(self.slots if end <= self.slots else self._slots_for_end(end))
        return end - 1 - ((end - 1 - slot) % self.capacity)

    def _slots_for_end(self, end: int) -> int:
        """Ring slots needed once positions up to ``end - 1`` are written.
        Until the ring is full-size, every position written is below its size."""
        if self.slots == self.capacity or end <= self.slots:
            return self.slots
        return min(self.capacity, -(-end // self.step) * self.step)

    def _grow(self, slots: int, like_keys: mx.array, like_values: mx.array) -> None:
        extra = slots - self.slots
        if extra == 0:
            return
        B, H, _, Dk = like_keys.shape
        new_k = mx.zeros((B, H, extra, Dk), like_keys.dtype)
        new_v = mx.zeros((B, H, extra, like_values.shape[3]), like_values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def _ring_write(self, ring: mx.array, new: mx.array) -> mx.array:
        capacity, n = self.capacity, new.shape[2]
        if n > capacity:
            new = new[:, :, n - capacity :]
        first = (self.offset + n - new.shape[2]) % capacity
        head = min(new.shape[2], capacity - first)
        ring[:, :, first : first + head] = new[:, :, :head]
        if head < new.shape[2]:
            ring[:, :, : new.shape[2] - head] = new[:, :, head:]
        return ring

    def _in_place(self, n: int) -> bool:
        return n <= self.max_rollback

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        check_window(self.window, window_size)
        o = self.offset
        if o == 0 and not self._in_place(N):
            return create_causal_mask(N, 0, window_size=self.window)
        written = max(self._end, o + 1) >= self.capacity
        if N == 1 and written and self._end - o <= self.max_rollback:
            # Every slot written, and at most ``max_rollback - 1`` positions
            # rolled back (a deeper trim is allowed while nothing has left
            # the ring): the one query sees all but the ``max_rollback - 1``
            # slots after its own (positions too old, or rolled back). A
            # third of the ops of the general mask, in every round of a
            # parked stream.
            shift = mx.remainder(mx.arange(self.capacity) - (o + 1), self.capacity)
            return (shift >= self.max_rollback - 1)[None]
        if self._in_place(N):
            # The ring after the write (stale slots, at or past o + N, are
            # in the causal future of every query).
            positions = self.slot_positions(max(self._end, o + N))
        else:
            # The ring before the write, without its stale slots, then the
            # new tokens.
            ring = self.slot_positions()
            positions = mx.concatenate(
                [mx.where(ring < o, ring, -1), mx.arange(o, o + N)]
            )
        return visible(positions[None], mx.arange(o, o + N)[:, None], self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        o = self.offset
        if self._in_place(n):
            fetched = None
        elif o == 0:
            fetched = (keys, values)
        else:
            fetched = (
                mx.concatenate([self.keys, keys], axis=2),
                mx.concatenate([self.values, values], axis=2),
            )
        self._grow(self._slots_for_end(o + n), keys, values)
        self.keys = self._ring_write(self.keys, keys)
        self.values = self._ring_write(self.values, values)
        self._start = max(self._start, o + n - self.capacity)
        self._end = max(self._end, o + n)
        self.offset += n
        return fetched or (self.keys, self.values)

    def rollback_depth(self) -> int:
        return self.max_rollback

    def rollback_limit(self) -> int:
        """How many of the newest tokens can be trimmed right now."""
        if self._start == 0:
            return self.offset
        return self.offset - (self.window - 1) - self._start

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"Cannot trim a negative number of tokens ({n}).")
        n = min(self.offset, n)
        if n > self.rollback_limit():
            raise ValueError(
                f"Cannot roll back {n} tokens of a sliding-window cache that "
                f"keeps only {self.rollback_limit()} tokens of history beyond "
                f"its window; create it with max_rollback >= {n}."
            )
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset - self._start

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @property
    def state(self):
        return (
            self.keys,
            self.values,
            self.offset,
            self.window,
            self.max_rollback,
            self._start,
            self._end,
        )

    @state.setter
    def state(self, v):
        (
            self.keys,
            self.values,
            self.offset,
            self.window,
            self.max_rollback,
            self._start,
            self._end,
        ) = v
