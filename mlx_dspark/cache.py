"""A sliding-window KV cache that can roll back rejected draft tokens.

mlx-lm's ``RotatingKVCache`` overwrites its oldest entries in place and stops
being trimmable once it has wrapped, so after the first window of context a
rejected draft stays in the cache and speculative decoding silently changes
the output. ``SlidingWindowKVCache`` keeps the ``window - 1 + max_rollback``
newest entries in order and hands each forward the slice its queries attend
to. Rolling back only moves ``offset`` back: the entries it leaves behind lie
past every later forward's slice until the same positions overwrite them.
"""

import math
from typing import Optional, Tuple

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

    The buffer holds the positions ``[start, end)`` in order, position ``p``
    at index ``p - start``, and keeps at least the ``window - 1 +
    max_rollback`` newest. A forward of ``N`` tokens at offset ``o`` gets
    the slice from position ``o - window + 1`` (or the oldest held) to ``o +
    N``: a one-token forward gets exactly its window and needs no mask,
    the same attention mlx-lm's ``RotatingKVCache`` gives it. (A ring needs
    a mask to hide what it keeps for a rollback, an op per layer in every
    token of a parked stream.) When a write would pass the buffer's end, the
    newest entries are copied to its front: at most once per a quarter window
    of tokens (256 at most, a rollback's worth at least), which is the
    buffer's room past what it must keep.

    Rolling back only moves ``offset`` back: the entries it leaves behind are
    past every later query's slice until they are overwritten by the same
    positions.

    The buffer grows in steps of 256 slots, so short contexts use little
    memory.

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
        self._start = 0  # the position at index 0
        self._end = 0  # highest position ever written, plus one

    @classmethod
    def holding(cls, window: int, max_rollback: int, keys, values, end: int):
        """A cache whose newest entries are ``keys`` and ``values``, the
        positions up to ``end - 1`` in order, with its offset at ``end``."""
        cache = cls(window, max_rollback)
        cache._keep(keys, values, end)
        return cache

    def _keep(self, keys: mx.array, values: mx.array, end: int) -> None:
        """Hold the newest ``capacity`` of ``keys`` and ``values``, the
        positions up to ``end - 1``, copied into a buffer of their own (the
        slices would keep all of ``keys`` alive), with room for a write."""
        kept = min(keys.shape[2], self.capacity)
        self.keys, self.values = keys[:, :, -kept:], values[:, :, -kept:]
        self.offset = self._end = end
        self._start = end - kept
        self._make_room(1, keys, values)

    @property
    def capacity(self) -> int:
        """The entries always kept: a window for the oldest query of a
        rollback's worth of tokens."""
        return self.window - 1 + self.max_rollback

    @property
    def limit(self) -> int:
        """The most slots the buffer grows to: room past the capacity for a
        quarter window of tokens (256 at most), or a rollback's worth."""
        return self.capacity + max(self.max_rollback, min(self.step, self.window // 4))

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def slot_positions(self) -> mx.array:
        """The position held by each slot (-1: never written)."""
        positions = self._start + mx.arange(self.slots)
        return mx.where(positions < self._end, positions, -1)

    def held(self) -> Tuple[mx.array, mx.array, int]:
        """Keys and values of the positions before the offset that a query
        at it or a rollback may need (at most ``capacity``), oldest first,
        and the first of those positions: slices of the buffer. The window
        before the offset is always among them, however deep a trim went."""
        first = max(
            self._start,
            min(self._end - self.capacity, self.offset - self.window + 1),
        )
        a, b = first - self._start, self.offset - self._start
        return self.keys[:, :, a:b], self.values[:, :, a:b], first

    def entries(self, start: int, end: int) -> Tuple[mx.array, mx.array]:
        """Keys and values of the positions in ``[start, end)`` the buffer
        holds, entries past the offset that a rollback left included: the
        slice a query at ``end - 1`` attends to."""
        a = max(start, self._start) - self._start
        b = max(min(end, self._end) - self._start, a)
        return self.keys[:, :, a:b], self.values[:, :, a:b]

    def _first_seen(self) -> int:
        """The oldest position the next forward's first query attends to."""
        return max(self._start, self.offset - self.window + 1)

    def _in_place(self, n: int) -> bool:
        return n <= self.max_rollback

    def _make_room(self, n: int, like_keys: mx.array, like_values: mx.array) -> None:
        """Slots for ``n`` tokens at the offset: the buffer grown, or its
        newest ``capacity - n`` entries moved to the front (the rest, and
        entries a rollback left past the offset, are no longer needed)."""
        o, start = self.offset, self._start
        need = o + n - start
        if need <= self.slots:
            return
        B, H, _, Dk = like_keys.shape
        if need > self.limit:
            start = o + n - self.capacity
            a, b = start - self._start, o - self._start
            keys, values = self.keys[:, :, a:b], self.values[:, :, a:b]
            self._start, self._end = start, o
            slots = self.limit
        else:
            keys, values = self.keys, self.values
            slots = min(self.limit, -(-need // self.step) * self.step)
        extra = slots - (0 if keys is None else keys.shape[2])
        new_k = mx.zeros((B, H, extra, Dk), like_keys.dtype)
        new_v = mx.zeros((B, H, extra, like_values.shape[3]), like_values.dtype)
        if keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([keys, new_k], axis=2)
            self.values = mx.concatenate([values, new_v], axis=2)

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        check_window(self.window, window_size)
        if N == 1 and not return_array:
            return None
        return create_causal_mask(
            N, self.offset - self._first_seen(), window_size=self.window
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n, o = keys.shape[2], self.offset
        first = self._first_seen()
        if not self._in_place(n):
            if self.keys is not None and o > first:
                seen_k, seen_v = self.entries(first, o)
                keys = mx.concatenate([seen_k, keys], axis=2)
                values = mx.concatenate([seen_v, values], axis=2)
            self._keep(keys, values, o + n)
            return keys, values
        self._make_room(n, keys, values)
        i = o - self._start
        self.keys[:, :, i : i + n] = keys
        self.values[:, :, i : i + n] = values
        self._end = max(self._end, o + n)
        self.offset += n
        return self.entries(first, o + n)

    def rollback_depth(self) -> int:
        return self.max_rollback

    def rollback_limit(self) -> int:
        """How many of the newest tokens can be trimmed right now."""
        if self._start == 0:
            return self.offset
        return max(0, self.offset - (self.window - 1) - self._start)

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
