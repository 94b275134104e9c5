"""Acceptance rules: pure functions of the drafts and the target's choices."""

import mlx.core as mx


def greedy_accept(drafts: mx.array, target_tokens: mx.array) -> mx.array:
    """The number of leading drafts equal to the target's argmax at their
    position (``target_tokens[i]`` is the target's choice for draft ``i``)."""
    matches = drafts == target_tokens[: drafts.size]
    return mx.cumprod(matches.astype(mx.int32)).sum()
