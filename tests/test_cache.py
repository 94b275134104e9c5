"""Rollback of the target's caches at any context length."""

import gc
import math
import re
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from mlx_dspark.batching.cache import BatchRollbackKVCache, _live_entries
from mlx_dspark.cache import SlidingWindowKVCache, rollback_depth, rollback_limit
from mlx_dspark.plugins import find_target_adapter

from tiny import tiny_gemma4, tiny_qwen3

H, D = 2, 8


def attend(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)


@st.composite
def histories(draw):
    """A window, a rollback depth and a sequence of (append k, keep j) steps
    that runs several windows long, mixing verify-sized writes with prompt
    chunks longer than the rollback depth."""
    window = draw(st.integers(1, 9))
    max_rollback = draw(st.integers(1, 6))
    steps = []
    for _ in range(draw(st.integers(1, 14))):
        k = draw(
            st.one_of(st.integers(1, max_rollback), st.integers(1, 3 * window + 4))
        )
        j = draw(st.integers(max(0, k - max_rollback), k))
        steps.append((k, j))
    growth = draw(st.integers(1, 5))  # ring growth step, 256 in production
    return window, max_rollback, growth, steps, draw(st.integers(0, 2**31 - 1))


@settings(
    max_examples=500 if settings().max_examples < 500 else settings().max_examples
)
@given(histories())
def test_rollback_equals_never_having_seen_the_dropped_tokens(case):
    """After any sequence of (append k, keep j), every query attends exactly as
    it would over a cache that only ever held the kept tokens."""
    window, max_rollback, growth, steps, seed = case
    mx.random.seed(seed)
    cache = SlidingWindowKVCache(window, max_rollback)
    cache.step = growth
    kept_k = mx.zeros((1, H, 0, D))
    kept_v = mx.zeros((1, H, 0, D))
    for k, j in steps + [(1, 1)]:
        new_k, new_v, q = (mx.random.normal((1, H, k, D)) for _ in range(3))
        mask = cache.make_mask(k, window_size=window)
        keys, values = cache.update_and_fetch(new_k, new_v)
        ours = attend(q, keys, values, mask)

        offset = kept_k.shape[2]
        ref_k = mx.concatenate([kept_k, new_k], axis=2)
        ref_v = mx.concatenate([kept_v, new_v], axis=2)
        expected = attend(
            q, ref_k, ref_v, create_causal_mask(k, offset, window_size=window)
        )
        np.testing.assert_allclose(np.array(ours), np.array(expected), atol=1e-5)

        cache.trim(k - j)
        kept_k, kept_v = ref_k[:, :, : offset + j], ref_v[:, :, : offset + j]
        assert cache.offset == kept_k.shape[2]
        # Memory is bounded by the window plus the rollback depth, and room
        # for a quarter window or a rollback's worth of writes.
        bound = window - 1 + max_rollback + max(max_rollback, window // 4)
        assert cache.keys.shape[2] <= cache.limit <= bound


@settings(
    max_examples=300 if settings().max_examples < 300 else settings().max_examples
)
@given(histories(), st.floats(0, 1))
def test_a_cache_trimmed_as_deep_as_allowed_joins_a_batch_with_its_whole_window(
    case, depth
):
    """A server's prompt cache trimmed to a shared prefix, as deep as
    ``rollback_limit`` allows, then merged into a speculative batch: the
    batch's next query, and the next one of the row taken back out of it,
    attend exactly as over the kept tokens alone."""
    window, max_rollback, growth, steps, seed = case
    mx.random.seed(seed)
    cache = SlidingWindowKVCache(window, max_rollback)
    cache.step = growth
    kept_k = kept_v = mx.zeros((1, H, 0, D))
    for k, j in steps:
        new_k, new_v = (mx.random.normal((1, H, k, D)) for _ in range(2))
        cache.update_and_fetch(new_k, new_v)
        cache.trim(k - j)
        kept_k = mx.concatenate([kept_k, new_k[:, :, :j]], axis=2)
        kept_v = mx.concatenate([kept_v, new_v[:, :, :j]], axis=2)
    dropped = round(depth * rollback_limit(cache))
    cache.trim(dropped)
    kept_k, kept_v = kept_k[:, :, : cache.offset], kept_v[:, :, : cache.offset]
    batch = BatchRollbackKVCache.merge([cache], window, max_rollback)
    single = None
    for _ in range(2):
        new_k, new_v, q = (mx.random.normal((1, H, 1, D)) for _ in range(3))
        offset = kept_k.shape[2]
        if single is None:
            mask = batch.make_mask(1, window_size=window)
            ours = attend(q, *batch.update_and_fetch(new_k, new_v), mask)
        else:
            mask = single.make_mask(1, window_size=window)
            ours = attend(q, *single.update_and_fetch(new_k, new_v), mask)
        kept_k = mx.concatenate([kept_k, new_k], axis=2)
        kept_v = mx.concatenate([kept_v, new_v], axis=2)
        expected = attend(q, kept_k, kept_v, create_causal_mask(1, offset, window_size=window))
        np.testing.assert_allclose(np.array(ours), np.array(expected), atol=1e-5)
        single = batch.extract(0)


@settings(
    max_examples=300 if settings().max_examples < 300 else settings().max_examples
)
@example(window=8, max_rollback=2, beyond_ring=0, depth=0.5, steps=2, seed=0)
@given(
    st.integers(1, 9),
    st.integers(1, 6),
    st.integers(-8, 30),
    st.floats(0, 1),
    st.integers(1, 12),
    st.integers(0, 2**31 - 1),
)
def test_one_row_queries_after_a_rollback_as_deep_as_allowed(
    window, max_rollback, beyond_ring, depth, steps, seed
):
    """A trim as deep as ``rollback_limit`` allows (the whole history, while
    nothing has left the ring: a server's prompt cache trimmed to a shared
    prefix), then one token at a time: each query attends exactly as over
    the kept tokens alone, however many rolled-back positions the ring
    still holds (more than ``max_rollback - 1`` of them, right after the
    ring is first filled)."""
    mx.random.seed(seed)
    cache = SlidingWindowKVCache(window, max_rollback)
    written = max(1, cache.capacity + beyond_ring)
    keys, values = (mx.random.normal((1, H, written, D)) for _ in range(2))
    cache.update_and_fetch(keys, values)
    cache.trim(round(depth * rollback_limit(cache)))
    kept_k, kept_v = keys[:, :, : cache.offset], values[:, :, : cache.offset]
    for _ in range(steps):
        new_k, new_v, q = (mx.random.normal((1, H, 1, D)) for _ in range(3))
        mask = cache.make_mask(1, window_size=window)
        ours = attend(q, *cache.update_and_fetch(new_k, new_v), mask)
        offset = kept_k.shape[2]
        kept_k = mx.concatenate([kept_k, new_k], axis=2)
        kept_v = mx.concatenate([kept_v, new_v], axis=2)
        expected = attend(q, kept_k, kept_v, create_causal_mask(1, offset, window_size=window))
        np.testing.assert_allclose(np.array(ours), np.array(expected), atol=1e-5)


def test_a_prompt_chunk_leaves_in_use_only_what_the_cache_holds():
    """A chunk's forward gets the window before it and the chunk, one
    concatenation; the cache keeps the newest entries copied into a buffer
    of its own, so once the forward's outputs are gone the whole chunk is
    freed (slices of it would keep it all alive)."""
    before = mx.get_active_memory()
    cache = SlidingWindowKVCache(window=64, max_rollback=4)
    chunk = mx.random.normal((1, H, 4096, D))
    fetched = cache.update_and_fetch(chunk, chunk)
    mx.eval(fetched, cache.keys, cache.values)
    chunk_bytes = sum(x.nbytes for x in fetched)  # 512 KiB
    del fetched, chunk
    gc.collect()
    # Slack for whatever else the process allocates meanwhile (a few KiB).
    assert mx.get_active_memory() - before < cache.nbytes + chunk_bytes // 8


def test_rolling_back_further_than_kept_history_is_refused():
    cache = SlidingWindowKVCache(window=4, max_rollback=2)
    cache.update_and_fetch(mx.zeros((1, 1, 10, 4)), mx.zeros((1, 1, 10, 4)))
    cache.trim(2)
    with pytest.raises(ValueError, match="Cannot roll back 1 tokens"):
        cache.trim(1)


@st.composite
def target_histories(draw):
    verify = draw(st.integers(1, 5))
    steps = [
        (k, draw(st.integers(1, k)))
        for k in draw(st.lists(st.integers(1, verify), min_size=2, max_size=10))
    ]
    prompt = draw(st.lists(st.integers(5, 95), min_size=1, max_size=12))
    return verify, prompt, steps, draw(st.integers(0, 1000))


TARGETS = {
    "gemma4": lambda seed: tiny_gemma4(seed=seed, window=3),
    "gemma4-wrapper": lambda seed: tiny_gemma4(seed=seed, window=3, wrapper=True),
    "gemma4-kv-shared": lambda seed: tiny_gemma4(
        seed=seed, window=3, per_layer_input=8, kv_shared=2
    ),
    "qwen3": lambda seed: tiny_qwen3(seed=seed),
}


@pytest.mark.parametrize("kind", TARGETS)
@given(target_histories())
def test_target_rollback_matches_a_fresh_run_on_the_kept_tokens(kind, case):
    """Verify-and-trim on the target (Gemma-4: sliding window 3, crossed many
    times) leaves it predicting exactly what a run over only the kept tokens
    does."""
    verify, prompt, steps, seed = case
    model = TARGETS[kind](seed % 7)
    target = find_target_adapter(model).adapt(model)
    rng = np.random.default_rng(seed)
    cache = target.make_cache(verify)
    target(mx.array(prompt)[None], cache)
    kept = list(prompt)
    for k, j in steps:
        tokens = rng.integers(5, 95, size=k).tolist()
        target(mx.array(tokens)[None], cache)
        for c in cache:
            c.trim(k - j)
        kept += tokens[:j]
    probe = [7, 11]
    ours = target(mx.array(probe)[None], cache).logits
    fresh = target(mx.array(kept + probe)[None], target.make_cache(verify)).logits[
        :, -2:
    ]
    np.testing.assert_allclose(np.array(ours), np.array(fresh), atol=1e-4, rtol=1e-4)


def test_mlx_lm_rotating_cache_cannot_roll_back_once_wrapped():
    """Why this cache exists: mlx-lm's RotatingKVCache refuses trims after the
    window fills, and its trim would not restore the overwritten entries."""
    cache = RotatingKVCache(max_size=4)
    for _ in range(5):
        cache.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    assert not cache.is_trimmable()


def test_one_rollback_contract_for_every_cache_kind():
    """``rollback_depth`` (what a cache can drop after any write) and
    ``rollback_limit`` (what it can drop now) answer for mlx-lm's caches and
    ours alike; the engine, the server and the prompt-cache checks all ask
    them."""
    keys = mx.zeros((1, 1, 10, 4))
    full = KVCache()
    full.update_and_fetch(keys, keys)
    assert rollback_depth(full) == math.inf and rollback_limit(full) == 10
    rotating = RotatingKVCache(max_size=4)
    rotating.update_and_fetch(keys[:, :, :2], keys[:, :, :2])
    assert rollback_depth(rotating) == 0  # not yet wrapped, but it will
    assert rollback_depth(ArraysCache(1)) == 0 and rollback_limit(ArraysCache(1)) == 0
    ring = SlidingWindowKVCache(window=4, max_rollback=3)
    ring.update_and_fetch(keys, keys)
    assert rollback_depth(ring) == 3 and rollback_limit(ring) == ring.rollback_limit() == 3
    assert rollback_depth(BatchRollbackKVCache(4, 3)) == 3
    assert rollback_depth(BatchRollbackKVCache(None, 3)) == math.inf


def primitive_counts(*arrays) -> Counter:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        return Counter(re.findall(r'label ="([^"]+)"', path.read_text()))


@pytest.mark.parametrize("written", [6, 13, 40])  # not yet wrapped, wrapped, long past
def test_a_rings_live_entries_are_slices_in_position_order(written):
    """Merging a server's prompt cache into a batch reads each sliding
    window's live entries: oldest first, with their positions, and as plain
    slices of the ring (a gather per layer made the prefill that merges a
    cache several times slower on a GPU)."""
    ring = SlidingWindowKVCache(window=5, max_rollback=3)
    keys = mx.arange(written, dtype=mx.float32).reshape(1, 1, written, 1)
    for i in range(written):
        ring.update_and_fetch(keys[:, :, i : i + 1], keys[:, :, i : i + 1])
    ring.trim(2)
    mx.eval(ring.state[:2])
    k, v, positions = _live_entries(ring)
    assert not set(primitive_counts(k, v, positions)) & {"Gather", "ArgSort"}
    expected = list(range(max(0, written - ring.capacity), written - 2))
    assert positions.tolist() == expected
    assert k.reshape(-1).tolist() == v.reshape(-1).tolist() == expected


def test_batch_buffers_grow_to_multiples_of_the_step(monkeypatch):
    """A batch merged from prompt caches of any width, and the writes after
    it, keep its buffers at multiples of ``step``, so their shapes repeat
    round after round."""
    monkeypatch.setattr(BatchRollbackKVCache, "step", 8)
    single = KVCache()
    single.update_and_fetch(mx.zeros((1, 1, 5, 2)), mx.zeros((1, 1, 5, 2)))
    batch = BatchRollbackKVCache.merge([single], None, 4)
    widths = [batch.keys.shape[2]]
    for n in (3, 1, 9, 9):
        batch.update_and_fetch(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))
        assert batch.keys.shape[2] >= batch.size()
        widths.append(batch.keys.shape[2])
        assert batch.positions.shape[1] == widths[-1]
    assert widths == [16, 16, 16, 24, 32]  # grown twice, to the next multiple each time


def test_a_one_token_forward_past_the_window_launches_what_mlx_lms_does():
    """A parked round's forward on the rollback caches, past the window, puts
    the kernels of mlx-lm's own step on its ``RotatingKVCache`` in the graph
    and no more: each sliding layer attends to a slice of exactly its window,
    with no mask to build or apply (a slice is a view, and launches nothing).
    The token is one that neither grows the buffer nor compacts it (once a
    quarter window)."""
    model = tiny_gemma4(seed=0, window=16)
    target = find_target_adapter(model).adapt(model)
    ours, stock = target.make_cache(4), make_prompt_cache(model)
    for cache in (ours, stock):
        mx.eval(model(mx.arange(5, 35)[None], cache=cache))
        for token in (40, 41):
            mx.eval(model(mx.array([[token]]), cache=cache))
    slots = [c.slots for c in ours if isinstance(c, SlidingWindowKVCache)]
    graphs = [
        primitive_counts(model(mx.array([[42]]), cache=cache)) for cache in (ours, stock)
    ]
    assert [c.slots for c in ours if isinstance(c, SlidingWindowKVCache)] == slots
    assert graphs[0] - graphs[1] == Counter({"Slice": 2 * len(slots)})
    assert not graphs[1] - graphs[0]
