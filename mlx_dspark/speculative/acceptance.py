"""Acceptance rules: pure functions of the drafts, the proposal and target
distributions, and uniform random numbers, computed on the device."""

import mlx.core as mx


def greedy_accept(drafts: mx.array, target_tokens: mx.array) -> mx.array:
    """The number of leading drafts equal to the target's own token at their
    position (``target_tokens[..., i]`` is the target's choice for draft
    ``i``: its argmax, or its sample under target-sample matching); a
    leading batch axis gives one count per row."""
    matches = drafts == target_tokens[..., : drafts.shape[-1]]
    return mx.cumprod(matches.astype(mx.int32), axis=-1).sum(axis=-1)


def residual(p: mx.array, q: mx.array) -> mx.array:
    """``normalize(max(p - q, 0))`` row-wise; rows where ``p <= q`` everywhere
    (p == q up to rounding) fall back to ``p``, as DeepSpec's
    ``sample_residual`` does."""
    r = mx.maximum(p - q, 0.0)
    mass = r.sum(axis=-1, keepdims=True)
    return mx.where(mass > 1e-8, r / mx.maximum(mass, 1e-30), p)


def inverse_cdf(probs: mx.array, u: mx.array) -> mx.array:
    """The token at which the cumulative distribution first exceeds ``u``
    (scaled by the row's total), for ``u`` in [0, 1): token ``y`` is chosen
    for a fraction ``probs[y]`` of the interval, never one of probability 0."""
    cdf = mx.cumsum(probs, axis=-1)
    index = (cdf <= u * cdf[..., -1:]).sum(axis=-1)
    vocab = probs.shape[-1]
    last_positive = vocab - 1 - mx.argmax((probs > 0)[..., ::-1], axis=-1)
    return mx.minimum(index, last_positive).astype(mx.uint32)


def rejection_accept(
    drafts: mx.array, draft_log_probs: mx.array, target_log_probs: mx.array, u: mx.array
):
    """Speculative (rejection) sampling, Leviathan et al. / Chen et al.

    Draft ``i`` (drawn from ``q_i = exp(draft_log_probs[i])``) is accepted
    with probability ``min(1, p_i(x_i) / q_i(x_i))``, left to right, where
    ``p_i = exp(target_log_probs[i])``. At the first rejection the next token
    is drawn from ``normalize(max(p_i - q_i, 0))``; if all ``n`` drafts are
    accepted it is drawn from ``p_n``. Every emitted token is then exactly
    distributed as ``p``.

    Args:
        drafts: ``[n]``; draft_log_probs: ``[n, V]``; target_log_probs:
            ``[n + 1, V]``; u: ``[n + 1]`` uniforms in [0, 1) (the first ``n``
            decide acceptance, the last draws the next token).
    Returns:
        ``(accepted, tokens)``: the number of accepted drafts, and ``[n + 1]``
        tokens whose first ``accepted + 1`` are the ones to emit.
    """
    n = drafts.size
    p = mx.exp(target_log_probs)
    if n == 0:
        return mx.array(0), inverse_cdf(p, u)
    q = mx.exp(draft_log_probs)
    index = drafts[:, None].astype(mx.int32)
    p_x = mx.take_along_axis(p[:n], index, axis=-1)[:, 0]
    q_x = mx.take_along_axis(q, index, axis=-1)[:, 0]
    accept = u[:n] * q_x < p_x
    accepted = mx.cumprod(accept.astype(mx.int32)).sum()
    next_from = mx.concatenate([residual(p[:n], q), p[n:]])[accepted]
    next_token = inverse_cdf(next_from, u[n])
    tokens = mx.concatenate([drafts.astype(mx.uint32), next_token[None]])
    tokens = mx.where(mx.arange(n + 1) == accepted, next_token, tokens)
    return accepted, tokens
