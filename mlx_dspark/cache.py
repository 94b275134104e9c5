"""A sliding-window KV cache that can roll back rejected draft tokens.

mlx-lm's ``RotatingKVCache`` overwrites its oldest entries in place and stops
being trimmable once it has wrapped, so after the first window of context a
rejected draft stays in the cache and speculative decoding silently changes
the output. ``SlidingWindowKVCache`` keeps ``window - 1 + max_rollback``
entries in a ring (slot = position mod capacity) together with the absolute
position of every slot, and builds its attention mask from those positions.
Rolling back only moves ``offset`` back: the entries it leaves behind have
positions at or beyond ``offset``, so the causal mask hides them until they
are overwritten by the same positions.
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

_EMPTY = -(2**30)


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

    def __init__(self, window: int, max_rollback: int):
        if window < 1 or max_rollback < 1:
            raise ValueError(
                f"window ({window}) and max_rollback ({max_rollback}) must be >= 1"
            )
        self.window = window
        self.max_rollback = max_rollback
        self.keys = None
        self.values = None
        self.positions = None
        self.offset = 0
        self._start = 0

    step = 256

    @property
    def capacity(self) -> int:
        return self.window - 1 + self.max_rollback

    def _slots_for(self, n: int) -> int:
        """Ring slots needed to write ``n`` more tokens. Until the ring is
        full-size, every position written so far is below its size."""
        allocated = 0 if self.positions is None else self.positions.size
        end = self.offset + n
        if allocated == self.capacity or end <= allocated:
            return allocated
        return min(self.capacity, -(-end // self.step) * self.step)

    def _grow(self, slots: int, like_keys: mx.array, like_values: mx.array) -> None:
        allocated = 0 if self.positions is None else self.positions.size
        if slots == allocated:
            return
        B, H, _, Dk = like_keys.shape
        extra = slots - allocated
        new_k = mx.zeros((B, H, extra, Dk), like_keys.dtype)
        new_v = mx.zeros((B, H, extra, like_values.shape[3]), like_values.dtype)
        new_p = mx.full((extra,), _EMPTY, dtype=mx.int32)
        if self.positions is None:
            self.keys, self.values, self.positions = new_k, new_v, new_p
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)
            self.positions = mx.concatenate([self.positions, new_p])

    def _ring_write(self, ring: mx.array, new: mx.array, axis: int) -> mx.array:
        capacity = self.capacity
        n = new.shape[axis]
        if n > capacity:
            new = new[(slice(None),) * axis + (slice(n - capacity, None),)]
        first = (self.offset + n - new.shape[axis]) % capacity
        head = min(new.shape[axis], capacity - first)
        idx = (slice(None),) * axis
        ring[idx + (slice(first, first + head),)] = new[idx + (slice(0, head),)]
        if head < new.shape[axis]:
            rest = new.shape[axis] - head
            ring[idx + (slice(0, rest),)] = new[idx + (slice(head, None),)]
        return ring

    def _in_place(self, n: int) -> bool:
        return n <= self.max_rollback

    def _key_positions(self, n: int) -> Optional[mx.array]:
        """Positions of the keys ``update_and_fetch`` will return for ``n`` new
        tokens, or ``None`` when it returns only the new tokens."""
        new = mx.arange(self.offset, self.offset + n, dtype=mx.int32)
        if self.offset == 0 and not self._in_place(n):
            return None
        ring = mx.full((self._slots_for(n),), _EMPTY, dtype=mx.int32)
        if self.positions is not None:
            ring[: self.positions.size] = self.positions
        if self._in_place(n):
            return self._ring_write(ring, new, axis=0)
        stale = ring >= self.offset
        return mx.concatenate([mx.where(stale, _EMPTY, ring), new])

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        if window_size is not None and window_size != self.window:
            raise ValueError(
                f"This cache serves a window of {self.window} tokens, but the "
                f"layer asked for a mask with window {window_size}."
            )
        positions = self._key_positions(N)
        if positions is None:
            return create_causal_mask(N, 0, window_size=self.window)
        queries = mx.arange(self.offset, self.offset + N, dtype=mx.int32)[:, None]
        return (positions[None] <= queries) & (positions[None] > queries - self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        self._grow(self._slots_for(n), keys, values)
        if self._in_place(n):
            fetched = None
        elif self.offset == 0:
            fetched = (keys, values)
        else:
            fetched = (
                mx.concatenate([self.keys, keys], axis=2),
                mx.concatenate([self.values, values], axis=2),
            )
        new_positions = mx.arange(self.offset, self.offset + n, dtype=mx.int32)
        self.keys = self._ring_write(self.keys, keys, axis=2)
        self.values = self._ring_write(self.values, values, axis=2)
        self.positions = self._ring_write(self.positions, new_positions, axis=0)
        self._start = max(self._start, self.offset + n - self.capacity)
        self.offset += n
        return fetched or (self.keys, self.values)

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
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    @property
    def state(self):
        return (
            self.keys,
            self.values,
            self.positions,
            self.offset,
            self.window,
            self.max_rollback,
            self._start,
        )

    @state.setter
    def state(self, v):
        (
            self.keys,
            self.values,
            self.positions,
            self.offset,
            self.window,
            self.max_rollback,
            self._start,
        ) = v
