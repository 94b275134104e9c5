"""A batch KV cache whose rows roll back by different amounts.

mlx-lm's ``BatchKVCache`` trims every row by the same amount, and its
``BatchRotatingKVCache`` cannot roll back once the window has filled. In a
speculative batch every row accepts its own number of drafts, so here each
slot carries the position it holds (``-1``: none) and a row rolls back by
moving its ``offset`` and forgetting the slots at or past it: no data moves,
and the mask hides forgotten slots (never zeroed K/V, which would still take
part in the softmax).

All rows are written at one cursor, so a row that accepted fewer drafts
leaves holes; ``compact`` packs each row's live slots to the right between
rounds, dropping, for a sliding-window layer, the slots no query can reach
any more (older than ``window - 1 + max_rollback`` positions).
"""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache

from ..cache import SlidingWindowKVCache, check_window, visible


class BatchRollbackKVCache(_BaseCache):
    """Per-row positions, per-row rollback, one write cursor.

    Args:
        window: The layer's attention window, or ``None`` for full attention.
        max_rollback: The most tokens a row rolls back after a write; a
            sliding-window layer keeps that many beyond its window.
    """

    step = 256

    def __init__(self, window: Optional[int], max_rollback: int):
        self.window = window
        self.max_rollback = max_rollback
        self.keys = None
        self.values = None
        self.positions = None  # [B, slots] int32, -1 where free
        self.offset = None  # [B] int32: each row's next position (for RoPE)
        self._idx = 0  # slots in use (the write cursor)
        # The same on the host, so that no decision waits for the device:
        # row b holds exactly the positions [firsts[b], lengths[b]).
        self.lengths: List[int] = []
        self.firsts: List[int] = []

    # -- building -------------------------------------------------------

    @classmethod
    def merge(cls, caches: Sequence, window: Optional[int], max_rollback: int):
        """A batch of single-sequence caches (``KVCache`` or
        ``SlidingWindowKVCache``, possibly empty), each row right-aligned."""
        batch = cls(window, max_rollback)
        rows = [_live_entries(c) for c in caches]
        batch.lengths = [c.offset for c in caches]
        batch.firsts = [c.offset - r[0].shape[2] if r else c.offset for c, r in zip(caches, rows)]
        batch.offset = mx.array(batch.lengths, mx.int32)
        like = next((r for r in rows if r is not None), None)
        if like is None:
            return batch
        width = max(0 if r is None else r[0].shape[2] for r in rows)
        parts = [(k, v, p[None]) for k, v, p in (r or _no_entries(like) for r in rows)]
        batch._assemble(parts, width, like)
        return batch

    def _assemble(self, parts, width: int, like) -> None:
        """The buffers of ``parts`` (``(keys, values, positions)`` of row
        groups, one on top of the other), each right-aligned at slot
        ``width``, with room for one round's writes after it: written into
        buffers of that capacity, so the next round need not copy them
        again to grow (``_ensure``)."""
        k, v, _ = like
        rows = sum(p[0].shape[0] for p in parts)
        capacity = _rounded_up(width + self.max_rollback + 1, self.step)
        self.keys = mx.zeros((rows, k.shape[1], capacity, k.shape[3]), k.dtype)
        self.values = mx.zeros((rows, v.shape[1], capacity, v.shape[3]), v.dtype)
        self.positions = mx.full((rows, capacity), -1, mx.int32)
        row = 0
        for keys, values, positions in parts:
            n, first = keys.shape[0], width - keys.shape[2]
            if first < width:
                self.keys[row : row + n, :, first:width] = keys
                self.values[row : row + n, :, first:width] = values
                self.positions[row : row + n, first:width] = positions
            row += n
        self._idx = width

    def extract(self, idx: int, end: Optional[int] = None):
        """Row ``idx``'s positions before ``end`` (by default all it holds)
        as the single-sequence cache the engine uses; positions written
        since (a round still in flight) are left out."""
        end = self.lengths[idx] if end is None else end
        count = end - self.firsts[idx]
        if self.window is None and count != end:
            raise RuntimeError("A full-attention row lost part of its history.")
        if count == 0:
            if self.window is None:
                return KVCache()
            return SlidingWindowKVCache(self.window, self.max_rollback)
        live = self.positions[idx, : self._idx]
        order = mx.argsort(mx.where(live < end, live, -1))[self._idx - count :]
        keys = mx.take(self.keys[idx : idx + 1], order, axis=2)
        values = mx.take(self.values[idx : idx + 1], order, axis=2)
        if self.window is None:
            cache = KVCache()
            cache.update_and_fetch(keys, values)
            return cache
        return SlidingWindowKVCache.holding(
            self.window, self.max_rollback, keys, values, end
        )

    # -- the cache protocol --------------------------------------------

    def _ensure(self, n: int, keys: mx.array, values: mx.array) -> None:
        need = self._idx + n
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        B, H, _, Dk = keys.shape
        # Capacities stay multiples of ``step`` (a compacted cache starts at
        # any width), so the buffers' shapes and strides repeat.
        capacity = 0 if self.keys is None else self.keys.shape[2]
        grow = _rounded_up(need, self.step) - capacity
        new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
        new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
        new_p = mx.full((B, grow), -1, mx.int32)
        if self.keys is None:
            self.keys, self.values, self.positions = new_k, new_v, new_p
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)
            self.positions = mx.concatenate([self.positions, new_p], axis=1)

    def _new_positions(self, n: int) -> mx.array:
        return self.offset[:, None] + mx.arange(n, dtype=mx.int32)[None]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        self._ensure(n, keys, values)
        i = self._idx
        self.keys[:, :, i : i + n] = keys
        self.values[:, :, i : i + n] = values
        self.positions[:, i : i + n] = self._new_positions(n)
        self.offset = self.offset + n
        self.lengths = [length + n for length in self.lengths]
        self._idx += n
        return self.keys[:, :, : self._idx], self.values[:, :, : self._idx]

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        check_window(self.window, window_size)
        keys = self._positions_after(N)[:, None, None, :]
        queries = self._new_positions(N)[:, None, :, None]
        return visible(keys, queries, self.window)

    def view(self, start: mx.array, end: mx.array):
        """Each row's entries at positions ``[start[b], end[b])``: the keys
        and values of every slot and the mask (``[B, 1, 1, slots]``) of
        those entries, for a drafter that borrows them (one query a row)."""
        positions = self.positions[:, : self._idx]
        visible = (positions >= start[:, None]) & (positions < end[:, None])
        return self.keys[:, :, : self._idx], self.values[:, :, : self._idx], visible[:, None, None]

    def block_mask(self, N: int) -> mx.array:
        """For a drafter's block that sees every live slot and itself."""
        return (self._positions_after(N) >= 0)[:, None, None, :]

    def _positions_after(self, N: int) -> mx.array:
        live = self.positions[:, : self._idx] if self._idx else None
        new = self._new_positions(N)
        return new if live is None else mx.concatenate([live, new], axis=1)

    def trim_rows(self, counts: Sequence[int]) -> None:
        """Roll row ``b`` back by ``counts[b]`` tokens of the latest write."""
        self.rollback(mx.array(counts, mx.int32))
        self.settle(counts, reuse=True)

    def rollback(self, counts: mx.array) -> None:
        """``trim_rows`` with the counts still on the device: the host's
        ``lengths`` catch up in ``settle``, so the next write need not wait
        for the counts."""
        self.offset = self.offset - counts
        self.positions = mx.where(
            self.positions >= self.offset[:, None], -1, self.positions
        )

    def settle(self, counts: Sequence[int], reuse: bool) -> None:
        """The host's side of a ``rollback`` by ``counts``. With ``reuse``
        (nothing written since), the slots every row freed are written
        again; otherwise they stay holes until ``compact``."""
        self.lengths = [length - c for length, c in zip(self.lengths, counts)]
        if reuse:
            self._idx -= min(counts)

    def trim(self, n: int) -> int:
        self.trim_rows([n] * len(self.lengths))
        return n

    def is_trimmable(self) -> bool:
        return True

    def rollback_depth(self) -> float:
        return self.max_rollback if self.window is not None else float("inf")

    def _capacity(self) -> float:
        """The most positions a row keeps once compacted."""
        if self.window is None:
            return float("inf")
        return self.window - 1 + self.max_rollback

    def reclaimable(self) -> int:
        """Slots ``compact`` would free."""
        return self._idx - self._span()

    def _span(self) -> int:
        capacity = self._capacity()
        return max(
            (min(n - f, capacity) for n, f in zip(self.lengths, self.firsts)), default=0
        )

    def compact(self) -> None:
        """Pack each row's live slots to the right, dropping the slots no
        later query can see. The layout changes, so call it between rounds,
        on every cache of the batch."""
        if self.keys is None or self.reclaimable() == 0:
            return
        capacity = self._capacity()
        self.firsts = [max(f, n - capacity) for n, f in zip(self.lengths, self.firsts)]
        width = self._span()
        live = self.positions[:, : self._idx]
        keep = live >= mx.array(self.firsts, mx.int32)[:, None]
        # A stable order with the kept slots last, in their order; then room
        # for a round's write (copies of slot 0, free by their positions), so
        # that the next round need not grow the packed buffers again.
        rank = keep.astype(mx.int32) * self._idx + mx.arange(self._idx)
        order = mx.argsort(rank, axis=1)[:, self._idx - width :]
        room = _rounded_up(width + self.max_rollback + 1, self.step) - width
        order = mx.concatenate([order, mx.zeros((order.shape[0], room), order.dtype)], axis=1)
        self.keys = mx.take_along_axis(self.keys, order[:, None, :, None], axis=2)
        self.values = mx.take_along_axis(self.values, order[:, None, :, None], axis=2)
        positions = mx.take_along_axis(live, order, axis=1)
        kept = mx.take_along_axis(keep, order, axis=1) & (mx.arange(width + room) < width)
        self.positions = mx.where(kept, positions, -1)
        self._idx = width

    def filter(self, keep: List[int]) -> None:
        index = mx.array(keep, mx.int32)
        self.offset = self.offset[index]
        self.lengths = [self.lengths[i] for i in keep]
        self.firsts = [self.firsts[i] for i in keep]
        if self.keys is not None:
            self.keys = self.keys[index]
            self.values = self.values[index]
            self.positions = self.positions[index]

    def select(self, rows: List[int]) -> "BatchRollbackKVCache":
        """A new cache of the rows at ``rows``."""
        taken = BatchRollbackKVCache(self.window, self.max_rollback)
        taken.keys, taken.values, taken.positions = self.keys, self.values, self.positions
        taken.offset, taken._idx = self.offset, self._idx
        taken.lengths, taken.firsts = self.lengths, self.firsts
        taken.filter(rows)
        return taken

    def extend(self, other: "BatchRollbackKVCache") -> None:
        """Append ``other``'s rows (both right-aligned at their cursors)."""
        like = self if self.keys is not None else other
        if like.keys is not None:
            width = max(self._idx, other._idx)
            parts = [_entries(c, like) for c in (self, other)]
            self._assemble(parts, width, (like.keys, like.values, None))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.lengths = self.lengths + other.lengths
        self.firsts = self.firsts + other.firsts

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    @property
    def state(self):
        return self.keys, self.values, self.positions, self.offset


def _rounded_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


def _entries(cache: BatchRollbackKVCache, like: BatchRollbackKVCache):
    """A batch cache's used slots (none for an empty one) as
    ``(keys, values, positions)``."""
    if cache.keys is None:
        B = len(cache.lengths)
        k = mx.zeros((B, like.keys.shape[1], 0, like.keys.shape[3]), like.keys.dtype)
        v = mx.zeros((B, like.values.shape[1], 0, like.values.shape[3]), like.values.dtype)
        return k, v, mx.zeros((B, 0), mx.int32)
    i = cache._idx
    return cache.keys[:, :, :i], cache.values[:, :, :i], cache.positions[:, :i]


def _no_entries(like):
    k, v, _ = like
    return (
        mx.zeros((1, k.shape[1], 0, k.shape[3]), k.dtype),
        mx.zeros((1, v.shape[1], 0, v.shape[3]), v.dtype),
        mx.zeros((0,), mx.int32),
    )


def _live_entries(cache):
    """``(keys, values, positions)`` of a single-sequence cache's entries
    that a query at its offset may still need, oldest first; ``None`` when
    it has none."""
    offset = cache.offset
    if not isinstance(cache, (SlidingWindowKVCache, KVCache)):
        raise TypeError(f"{type(cache).__name__} cannot join a speculative batch.")
    if cache.keys is None or offset == 0:
        return None
    if isinstance(cache, SlidingWindowKVCache):
        keys, values, first = cache.held()
        return keys, values, mx.arange(first, offset, dtype=mx.int32)
    return (
        cache.keys[:, :, :offset],
        cache.values[:, :, :offset],
        mx.arange(offset, dtype=mx.int32),
    )
