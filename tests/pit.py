"""Sampling at every offset of a round: the randomized probability integral
transform (PIT) of each emitted token against the target's exact
distribution given the emitted prefix, grouped by the token's offset in its
round. Shared by the single-stream test (tests/test_sampling.py) and the
batch's (tests/test_batching.py).

Lossless output makes the transforms i.i.d. uniform, for any order of the
vocabulary fixed before the token is drawn, and any grouping fixed before
it too: the offset is (a round's earlier drafts were all accepted, and
drafts are proposed before any is verified); whether the token was accepted
is not, and would bias the groups.
"""

import functools
import math
from collections import Counter

import mlx.core as mx
import numpy as np

from mlx_dspark.speculative.sampling import SamplingSpec

from chisquare import goodness_of_fit


def round_positions(stats, proposals, length, vocab):
    """For each emitted token, its offset within its round and what the
    drafter proposed at it (its distribution, or one-hot at an argmax draft;
    ``None`` for the first token and the bonus tokens). ``proposals`` holds,
    for each round of ``stats`` that drafted, the drafter's log-probabilities
    of its drafts (``None``: argmax drafts)."""
    positions, proposals = [(0, None)], iter(proposals)
    for r in stats.history:
        q = next(proposals) if r.drafts else None
        if q is not None:
            q = np.exp(np.array(q, np.float64))
        elif r.drafts:
            q = np.eye(vocab)[r.drafts]
        for j in range(r.accepted + (r.next_token is not None)):
            positions.append((j, q[j] if j < r.proposed else None))
    return positions[:length]


def target_log_probs(model, prompt, tokens, processors):
    """``[len(tokens), V]``: the target's log-probabilities at each emitted
    token given the prompt and the tokens before it, after the request's
    logits processors (as mlx-lm's ``generate_step`` yields them)."""
    history = mx.array(prompt + tokens)
    logits = model(history[None])[0, len(prompt) - 1 : -1]
    if processors:
        logits = mx.concatenate(
            [
                functools.reduce(
                    lambda row, f: f(history[: len(prompt) + i], row),
                    processors,
                    logits[i : i + 1],
                )
                for i in range(len(tokens))
            ]
        )
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def target_probabilities(model, prompt, tokens, settings, processors):
    """``[len(tokens), V]``: the target's distribution at each emitted token
    given the prompt and the tokens before it, as plain sampling draws it
    (the request's processors, then the sampler's settings)."""
    logprobs = target_log_probs(model, prompt, tokens, processors)
    return np.exp(np.array(SamplingSpec(**settings).log_probs(logprobs), np.float64))


def probability_integral_transforms(tokens, probs, positions, rng):
    """For every emitted token ``y``: ``P(Y before y) + v P(y)`` (``v``
    uniform) under its target distribution ``p`` (a row of ``probs``), and
    a cut. Where the drafter proposed ``q``, the vocabulary is ordered by
    ``q - p`` (what the drafter over-proposes first) and the cut is the mass
    ``p`` gives the over-proposed tokens; elsewhere it is ordered by ``p``
    and there is no cut (``nan``)."""
    transforms, cuts = [], []
    for y, p, (_, q) in zip(tokens, probs, positions):
        order = np.argsort(-(p if q is None else q - p), kind="stable")
        rank = np.argmax(order == y)
        transforms.append(p[order[:rank]].sum() + rng.random() * p[y])
        cuts.append(np.nan if q is None else p[q > p].sum())
    return transforms, cuts


def last_token_bias(tokens, logits):
    """A logits processor that moves a seventh of the vocabulary, which one
    depending on the last token: a change at every position, right only
    with the right history."""
    return logits + 2.0 * (mx.arange(logits.shape[-1]) % 7 == tokens[-1] % 7)


def check_every_offset(transforms, cuts, offsets, alpha, min_group=100, min_cut=50):
    """Offsets 0, 1 and 2 or more, each: uniform on deciles (chi-square),
    and below the cut exactly as often as the cut says (a martingale, the
    cut being known before the token; two-sided z-test). ``min_group``
    transforms at least in each group, and ``min_cut`` with a cut beyond
    offset 0, so that the test has power where drafts were accepted."""
    transforms, cuts = np.asarray(transforms), np.asarray(cuts)
    offsets = np.minimum(offsets, 2)
    for offset in range(3):
        group = transforms[offsets == offset]
        assert group.size > min_group, (offset, group.size)
        deciles = Counter(np.minimum(group * 10, 9).astype(int).tolist())
        p_value = goodness_of_fit(deciles, dict.fromkeys(range(10), 0.1))
        assert p_value > alpha, (offset, "deciles", p_value)
        cut = cuts[offsets == offset]
        below, cut = group[~np.isnan(cut)] < cut[~np.isnan(cut)], cut[~np.isnan(cut)]
        z = (below - cut).sum() / np.sqrt((cut * (1 - cut)).sum())
        assert offset == 0 or below.size > min_cut, (offset, below.size)
        p_value = math.erfc(abs(z) / math.sqrt(2))
        assert p_value > alpha, (offset, "cut", z)
