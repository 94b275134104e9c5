"""Sampling at temperature > 0 and logits processors.

The acceptance rules are checked as pure functions (hypothesis, exact), and
end to end statistically: every statistical test below uses fixed seeds and a
chi-square goodness-of-fit test at significance 1e-4. The tests are
deterministic; a correct implementation would fail one of them for a fraction
1e-4 of possible seeds, so fewer than 1e-3 over the whole file.
"""

import copy
import functools
import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_dspark.speculative.sampling import mlx_lm_make_sampler

import mlx_dspark
from mlx_dspark import SpeculativeStats, speculative_generate_step
from mlx_dspark.confidence.schedulers import ThresholdScheduler
from mlx_dspark.speculative.acceptance import inverse_cdf, rejection_accept, residual
from mlx_dspark.speculative.decoding import Decoding, acceptance_rule
from mlx_dspark.speculative.sampling import SamplingSpec, make_sampler

from chisquare import goodness_of_fit
from pit import (
    check_every_offset,
    last_token_bias,
    probability_integral_transforms,
    round_positions,
    target_probabilities,
)
from conftest import DEEPSPEC_TINY
from test_confidence import TableCostScheduler
from test_lossless import random_drafter_kwargs
from tiny import (
    cut_at_stop,
    gemma4_text_args,
    pick_stops,
    rounds,
    rounds_cut_at,
    speculative,
    tiny_dspark,
    tiny_gemma4,
)

ALPHA = 1e-4


@st.composite
def distributions(draw, vocab=None, zeros=True):
    vocab = vocab or draw(st.integers(2, 6))
    weights = draw(
        st.lists(
            st.floats(0.0 if zeros else 0.05, 1.0), min_size=vocab, max_size=vocab
        ).filter(lambda w: sum(w) > 0.05)
    )
    total = sum(weights)
    return [w / total for w in weights]


def as_log(probs):
    return mx.log(mx.array(probs, mx.float32))


@given(st.data())
def test_drafts_from_the_target_distribution_are_all_accepted(data):
    p = data.draw(distributions(zeros=False))
    n = data.draw(st.integers(1, 4))
    drafts = data.draw(st.lists(st.integers(0, len(p) - 1), min_size=n, max_size=n))
    u = data.draw(st.lists(st.floats(0, 0.999999), min_size=n + 1, max_size=n + 1))
    log_p = mx.broadcast_to(as_log(p), (n + 1, len(p)))
    accepted, tokens = rejection_accept(
        mx.array(drafts), log_p[:n], log_p, mx.array(u, mx.float32)
    )
    assert accepted.item() == n
    assert tokens[:n].tolist() == drafts


@given(st.data())
def test_a_draft_is_accepted_with_probability_min_1_p_over_q(data):
    """For draft x, acceptance is exactly the event u < min(1, p(x)/q(x)):
    so one step accepts with probability sum_x q(x) min(1, p/q) = sum min(p, q)."""
    vocab = data.draw(st.integers(2, 6))
    p = data.draw(distributions(vocab, zeros=True))
    q = data.draw(distributions(vocab, zeros=False))
    x = data.draw(st.integers(0, vocab - 1))
    ratio = min(1.0, p[x] / q[x])
    log_p = mx.stack([as_log(p), as_log(p)])

    def accepts(u):
        accepted, _ = rejection_accept(
            mx.array([x]), as_log(q)[None], log_p, mx.array([u, 0.5], mx.float32)
        )
        return accepted.item() == 1

    if ratio > 1e-4:
        assert accepts(ratio * (1 - 1e-4))
    if ratio < 1 - 1e-4:
        assert not accepts(ratio * (1 + 1e-4) + 1e-6)


@given(st.data())
def test_the_residual_is_a_distribution(data):
    vocab = data.draw(st.integers(2, 8))
    p = np.array(data.draw(distributions(vocab)))
    q = np.array(data.draw(distributions(vocab)))
    r = np.array(residual(mx.array(p, mx.float32), mx.array(q, mx.float32)))
    assert (r >= 0).all() and r.sum() == pytest.approx(1, abs=1e-5)
    # Against the residual of the float32 inputs: where p and q nearly
    # cancel, their rounding alone moves the float64 one by more than 1e-5.
    p, q = (x.astype(np.float32).astype(np.float64) for x in (p, q))
    if np.maximum(p - q, 0).sum() > 1e-6:
        assert (r[q >= p] == 0).all()
        np.testing.assert_allclose(
            r, np.maximum(p - q, 0) / np.maximum(p - q, 0).sum(), rtol=1e-5, atol=1e-7
        )


def test_a_rejection_draws_from_the_residual_of_its_own_position():
    """Draft 0 is accepted (p_0 = q_0), draft 1 always rejected (p_1 = 0 at
    it): the next token comes from ``normalize(max(p_1 - q_1, 0))``, which is
    token 1 alone here, never from position 0's ``max(p_1 - q_0, 0)`` (token
    0 alone)."""
    q = mx.log(mx.array([[0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]))
    p = mx.log(mx.array([[0.0, 0.5, 0.5], [0.5, 0.5, 0.0], [1 / 3] * 3]))
    for u_next in (0.0, 0.3, 0.6, 0.99):
        accepted, tokens = rejection_accept(
            mx.array([1, 2]), q, p, mx.array([0.5, 0.0, u_next])
        )
        assert accepted.item() == 1 and tokens[:2].tolist() == [1, 1]


@given(distributions(), st.floats(0.999, 0.9999999))
def test_inverse_cdf_never_picks_an_impossible_token(probs, u):
    token = inverse_cdf(mx.array(probs, mx.float32), mx.array(u, mx.float32)).item()
    assert probs[token] > 0


@given(st.data())
def test_the_emitted_token_is_distributed_exactly_as_p(data):
    """Integrate one round with one draft over x ~ q and both uniforms (on
    fine grids): the emitted token is distributed as p."""
    vocab = data.draw(st.integers(2, 5))
    p = data.draw(distributions(vocab))
    q = data.draw(distributions(vocab, zeros=False))
    log_p = mx.stack([as_log(p), as_log(p)])

    def round_with(x, u_accept, u_next):
        accepted, tokens = rejection_accept(
            mx.array([x]),
            as_log(q)[None],
            log_p,
            mx.array([u_accept, u_next], mx.float32),
        )
        return accepted.item(), tokens[accepted.item()].item()

    accept_grid, next_grid = (np.arange(200) + 0.5) / 200, (np.arange(400) + 0.5) / 400
    emitted = np.zeros(vocab)
    for x in range(vocab):
        accept_rate = np.mean([round_with(x, u, 0.5)[0] for u in accept_grid])
        emitted[x] += q[x] * accept_rate
        if accept_rate < 1:
            # Given a rejection, the next token depends only on the second uniform.
            u_reject = accept_grid[-1]
            for u in next_grid:
                emitted[round_with(x, u_reject, u)[1]] += (
                    q[x] * (1 - accept_rate) / next_grid.size
                )
    np.testing.assert_allclose(emitted, p, atol=0.02)


SETTINGS = [
    dict(temp=1.0),
    dict(temp=0.5),
    dict(temp=1.3, top_p=0.8),
    dict(temp=0.9, top_k=4),
    dict(temp=1.0, min_p=0.1),
    dict(temp=0.8, top_p=0.95, min_p=0.05, top_k=6),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_sampling_spec_is_what_mlx_lms_sampler_draws_from(settings):
    """200k draws of mlx-lm's own sampler match SamplingSpec.log_probs."""
    mx.random.seed(7)
    logits = mx.random.normal((1, 12)) * 2
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampler = mlx_lm_make_sampler(**settings)
    samples = sampler(mx.broadcast_to(logprobs, (200_000, 12))).tolist()
    expected = mx.exp(SamplingSpec(**settings).log_probs(logprobs))[0].tolist()
    assert goodness_of_fit(Counter(samples), dict(enumerate(expected))) > ALPHA


@pytest.mark.parametrize("sampler", [None, make_sampler(1.0)], ids=["greedy", "T=1"])
def test_the_drafters_processors_see_the_drafts_so_far(sampler):
    """As mlx-lm's generate_step would call them for the drafted tokens."""
    seen = []

    def processor(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    draw = Decoding(sampler, (processor,)).draw_for(mx.array([1, 2]))
    drafts = [draw(mx.array([[0.0, 50.0, 0.0]]))[0], draw(mx.array([[0.0, 0.0, 50.0]]))[0]]
    assert [d.item() for d in drafts] == [1, 2]
    assert seen == [[1, 2], [1, 2, 1]]


def test_which_rule_each_sampler_gets():
    assert acceptance_rule(None) == "greedy"
    assert acceptance_rule(make_sampler(0.0)) == "greedy"
    assert acceptance_rule(make_sampler(0.7, top_p=0.9)) == "rejection"
    assert acceptance_rule(make_sampler(0.7, xtc_probability=0.5)) == "match"
    assert acceptance_rule(mlx_lm_make_sampler(0.7)) == "match"  # mlx-lm's own
    assert acceptance_rule(lambda logprobs: mx.argmax(logprobs, axis=-1)) == "match"


@functools.lru_cache(maxsize=None)
def tiny():
    model, _ = load(str(DEEPSPEC_TINY / "target_tiny_gemma4"))
    drafter = mlx_dspark.load_drafter(DEEPSPEC_TINY / "dspark_tiny_gemma4_block4")
    return model, drafter


PROMPT = [65, 211, 266, 241]


def exact_distribution(model, settings, processors_kwargs, length, floor=2e-4):
    """P(first ``length`` tokens) of plain sampling from the target: the
    target's next-token distribution after mlx-lm's processors and the
    sampler settings, expanded as a tree (branches below ``floor`` dropped,
    their mass left to the test's "other" category)."""
    spec = SamplingSpec(**settings)
    processors = make_logits_processors(**processors_kwargs)
    result = {}

    def expand(prefix, probability):
        if len(prefix) == length:
            result[tuple(prefix)] = probability
            return
        tokens = mx.array(PROMPT + prefix)
        logits = model(tokens[None])[:, -1]
        for processor in processors:
            logits = processor(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        probs = mx.exp(spec.log_probs(logprobs))[0].tolist()
        for token, p in enumerate(probs):
            if probability * p >= floor:
                expand(prefix + [token], probability * p)

    expand([], 1.0)
    return result


def sample_runs(generate, runs, length, seed=0):
    counts = Counter()
    for i in range(runs):
        mx.random.seed(seed * 100_000 + i)
        counts[tuple(generate()[:length])] += 1
    return counts


STATISTICAL = [
    ("T=1.0", dict(temp=1.0), {}),
    ("T=0.7", dict(temp=0.7), {}),
    ("T=1.0 top-p 0.9", dict(temp=1.0, top_p=0.9), {}),
    ("T=0.7 top-k 5", dict(temp=0.7, top_k=5), {}),
    ("T=1.0 min-p 0.1", dict(temp=1.0, min_p=0.1), {}),
    ("T=1.0 logit bias + repetition penalty", dict(temp=1.0), "biased"),
]


def biased_processors():
    """Penalise the target's greedy continuation, so that the processors
    change the distribution at every position tested."""
    model, _ = tiny()
    greedy = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=3)]
    return dict(logit_bias={t: -1.5 for t in greedy}, repetition_penalty=1.5)


@pytest.mark.parametrize(
    "name,settings,processors", STATISTICAL, ids=[s[0] for s in STATISTICAL]
)
def test_speculative_sampling_has_the_targets_distribution(name, settings, processors):
    """The joint distribution of the first three tokens (the first from the
    prompt, the next two through a round of drafts and rejection sampling)
    equals the target's."""
    model, drafter = tiny()
    sampler = make_sampler(**settings)
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    processors = biased_processors() if processors == "biased" else processors
    kwargs = dict(sampler=sampler, logits_processors=make_logits_processors(**processors))
    counts = sample_runs(
        lambda: speculative(model, drafter, PROMPT, 3, stats, **kwargs)[0], 600, 3
    )
    assert stats.acceptance_rule == "rejection" and stats.accepted > 0
    expected = exact_distribution(model, settings, processors, 3)
    assert goodness_of_fit(counts, expected) > ALPHA


def test_plain_mlx_lm_sampling_has_the_same_distribution():
    """The reference above is what mlx-lm's own sampling draws from."""
    model, _ = tiny()
    settings, processors = dict(temp=1.0, top_p=0.9), biased_processors()

    def plain():
        steps = generate_step(
            mx.array(PROMPT),
            model,
            max_tokens=3,
            sampler=mlx_lm_make_sampler(**settings),
            logits_processors=make_logits_processors(**processors),
        )
        return [t for t, _ in steps]

    counts = sample_runs(plain, 600, 3, seed=1)
    assert (
        goodness_of_fit(counts, exact_distribution(model, settings, processors, 3))
        > ALPHA
    )


def test_target_sample_matching_has_the_targets_distribution():
    """An opaque sampler (no known distribution) falls back to matching the
    target's own samples: still the target's distribution."""
    model, drafter = tiny()
    mlx_lm_sampler = mlx_lm_make_sampler(temp=1.0)
    stats = SpeculativeStats(drafter.name, drafter.block_size)

    counts = sample_runs(
        lambda: speculative(model, drafter, PROMPT, 3, stats, sampler=mlx_lm_sampler)[0],
        600,
        3,
        seed=2,
    )
    assert stats.acceptance_rule == "match" and stats.accepted > 0
    assert (
        goodness_of_fit(counts, exact_distribution(model, dict(temp=1.0), {}, 3))
        > ALPHA
    )


PIT = [
    ("rejection", "none", None),
    ("rejection", "biased", None),
    ("rejection", "none", "threshold"),
    ("match", "none", None),
    ("match", "biased", "threshold"),
]


@pytest.mark.parametrize("rule,processors,scheduler", PIT, ids=map(str, PIT))
def test_every_offset_of_a_round_has_the_targets_distribution(
    rule, processors, scheduler, monkeypatch
):
    """Tokens at every offset within a round are distributed as the target's.

    For each emitted token, its randomized probability integral transform
    against the target's exact distribution given the emitted prefix is
    i.i.d. uniform exactly when the output is lossless (for any order of the
    vocabulary fixed before the token is drawn). The transforms are grouped
    by the token's offset in its round (fixed before the token is drawn;
    whether it was accepted is not, and would bias the groups), and each
    group is tested for uniformity on deciles, and at the cut below which
    lie the tokens the drafter over-proposes (where a wrong rejection
    residual shows: rejections move mass across it). 24-token generations at
    temperature 0.7 make rounds of up to four accepted drafts. Catches, among
    others, a rejection residual drawn with another position's proposal (the
    first draft's: a bias at offsets 1 and beyond only, |z| from 3.9 to 6.3
    at the cut in the three rejection cases) and logits processors left out
    at verified rows (the deciles, p < 1e-12)."""
    model, drafter = tiny()
    settings = dict(temp=0.7)
    sampler = make_sampler(**settings)
    if rule == "match":
        sampler = mlx_lm_make_sampler(**settings)
    processors = [last_token_bias] if processors == "biased" else []
    if scheduler == "threshold":
        scheduler = ThresholdScheduler(0.3)
    proposals, propose = [], drafter.propose

    def recording(*args, **kwargs):
        proposals.append(propose(*args, **kwargs))
        return proposals[-1]

    monkeypatch.setattr(drafter, "propose", recording)
    rng = np.random.default_rng(0)
    transforms, cuts, offsets = [], [], []
    for seed in range(60):
        mx.random.seed(seed)
        tokens, stats = speculative(
            model,
            drafter,
            PROMPT,
            24,
            sampler=sampler,
            logits_processors=processors,
            scheduler=scheduler,
        )
        qs = [p.log_probs for p in proposals]
        positions = round_positions(stats, qs, 24, model.args.vocab_size)
        probs = target_probabilities(model, PROMPT, tokens, settings, processors)
        t, c = probability_integral_transforms(tokens, probs, positions, rng)
        transforms += t
        cuts += c
        offsets += [j for j, _ in positions]
        proposals.clear()
    assert stats.acceptance_rule == rule
    check_every_offset(transforms, cuts, offsets, ALPHA)


def run_tokens(sampler, seed, max_tokens=24, processors=None):
    model, drafter = tiny()
    mx.random.seed(seed)
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    responses = list(
        speculative_generate_step(
            mx.array(PROMPT),
            model,
            drafter,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
            stats=stats,
        )
    )
    return responses, stats


def test_same_seed_same_output():
    sampler = make_sampler(0.8, top_p=0.95)
    a, _ = run_tokens(sampler, seed=5)
    b, _ = run_tokens(sampler, seed=5)
    c, _ = run_tokens(sampler, seed=6)
    assert [t for t, _, _ in a] == [t for t, _, _ in b] != [t for t, _, _ in c]


# Sampler settings for random tiny models: at temperature 2 to 4 a random
# drafter's drafts are often accepted (rounds of several accepted drafts).
SAMPLED = [
    ("rejection", dict(temp=2.0)),
    ("rejection", dict(temp=4.0)),
    ("rejection", dict(temp=3.0, top_p=0.9)),
    ("rejection", dict(temp=2.0, top_k=12)),
    ("match", dict(temp=3.0)),
]


# Where ``pick_stops`` picks stop tokens: each sampled stop test tries all.
STOP_AT = ["last draft", "inner draft", "first", "any"]


def sampler_of(rule, settings):
    return (make_sampler if rule == "rejection" else mlx_lm_make_sampler)(**settings)


@st.composite
def sampled_stop_cases(draw):
    """A random Gemma-4 target and DSpark/DFlash drafter, a prompt, a budget,
    sampler settings, a seed, and which tokens of the unstopped output
    become stop tokens (``picks``, see ``pick_stops``)."""
    layers = draw(st.integers(2, 4))
    target_kwargs = dict(layers=layers, window=draw(st.integers(2, 6)))
    drafter_kwargs = random_drafter_kwargs(draw, layers)
    return dict(
        target_kwargs=target_kwargs,
        drafter_kwargs=drafter_kwargs,
        model_seed=draw(st.integers(0, 10_000)),
        prompt=draw(st.lists(st.integers(0, 95), min_size=1, max_size=16)),
        max_tokens=draw(st.integers(1, 40)),
        sampling=draw(st.sampled_from(SAMPLED)),
        seed=draw(st.integers(0, 10_000)),
        picks=draw(st.lists(st.integers(0, 1000), min_size=1, max_size=3)),
    )


@given(sampled_stop_cases())
def test_sampled_stop_tokens_cut_the_sampled_output_exactly(tiny_pair, case):
    """With sampling, stop tokens end the output exactly at the first of
    them: for a seed, the speculative output with stop tokens (the engine's
    ``stop_tokens``, and ``stream_generate`` with them as the tokenizer's
    EOS) is the one without them, cut after the first stop token, each
    token from a draft or not alike, and the rounds are the same but the
    last, which a stop among its accepted drafts ends there (no target
    token); stop tokens picked among a round's accepted drafts (its last
    one, or one another follows), the first token, and any tokens.

    Exact for a seed because stop tokens decide only where a round's emitted
    tokens end: everything before the stop, the random numbers drawn
    included, is the same. (Not the plain sampled output for the seed:
    speculative rounds draw other random numbers than one token at a time.
    That the unstopped output is distributed as plain sampling is the
    offset test's; with this property, so is the stopped one: plain
    sampling cut at the first stop.)"""
    model = tiny_gemma4(seed=case["model_seed"], **case["target_kwargs"])
    drafter = tiny_dspark(
        gemma4_text_args(**case["target_kwargs"]),
        seed=case["model_seed"] + 1,
        **case["drafter_kwargs"],
    )
    rule, settings = case["sampling"]
    prompt, max_tokens = case["prompt"], case["max_tokens"]

    def steps(**kwargs):
        mx.random.seed(case["seed"])
        stats = SpeculativeStats(drafter.name, drafter.block_size)
        out = speculative_generate_step(
            mx.array(prompt),
            model,
            drafter,
            max_tokens=max_tokens,
            sampler=sampler_of(rule, settings),
            stats=stats,
            **kwargs,
        )
        return [(t, d) for t, _, d in out], stats

    full, full_stats = steps()
    tokens, flags = [t for t, _ in full], [d for _, d in full]
    tokenizer = copy.deepcopy(tiny_pair[1])
    for where in STOP_AT:
        stops = pick_stops(tokens, flags, where, case["picks"])
        cut = len(cut_at_stop(tokens, stops))
        ours, stats = steps(stop_tokens=stops)
        assert ours == full[:cut], where
        assert rounds(stats) == rounds_cut_at(rounds(full_stats), cut), where

        tokenizer.eos_token_ids = stops
        mx.random.seed(case["seed"])
        responses = mlx_dspark.stream_generate(
            model,
            tokenizer,
            prompt,
            draft=drafter,
            max_tokens=max_tokens,
            sampler=sampler_of(rule, settings),
        )
        assert [(r.token, r.from_draft) for r in responses] == full[:cut], where

def test_logprobs_are_the_targets_processed_log_probabilities():
    model, _ = tiny()
    processors = make_logits_processors(logit_bias={7: 3.0}, repetition_penalty=1.3)
    responses, _ = run_tokens(make_sampler(1.0), seed=3, processors=processors)
    tokens = [t for t, _, _ in responses]
    history = mx.array(PROMPT + tokens)
    logits = model(history[None])[0]
    for i, (_, logprobs, _) in enumerate(responses):
        context = history[: len(PROMPT) + i]
        row = logits[len(PROMPT) + i - 1 : len(PROMPT) + i]
        for processor in processors:
            row = processor(context, row)
        expected = row - mx.logsumexp(row, axis=-1, keepdims=True)
        np.testing.assert_allclose(np.array(logprobs), np.array(expected[0]), atol=1e-4)


def test_rejection_sampling_accepts_more_than_target_sample_matching():
    """At temperature 1.0 on the bundled DSpark pair."""
    rejection, matching = SpeculativeStats("r", 4), SpeculativeStats("m", 4)
    for seed in range(40):
        rejection.history += run_tokens(make_sampler(1.0), seed)[1].history
        matching.history += run_tokens(mlx_lm_make_sampler(1.0), seed)[1].history
    rate = lambda s: s.accepted / s.drafted  # noqa: E731
    assert rate(rejection) > rate(matching) + 0.1
    assert rejection.tau > matching.tau


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_sampled_runs_keep_the_prompt_cache_exact(rule):
    """A second turn on a prompt cache after a sampled first turn continues
    exactly like a fresh run over the whole conversation (greedy second turn)."""
    model, drafter = tiny()
    sampler = make_sampler(1.0) if rule == "rejection" else mlx_lm_make_sampler(1.0)
    cache = mlx_dspark.make_prompt_cache(model, drafter)
    mx.random.seed(11)
    turn1 = [
        t
        for t, _, _ in speculative_generate_step(
            mx.array(PROMPT),
            model,
            drafter,
            max_tokens=17,
            sampler=sampler,
            prompt_cache=cache,
        )
    ]
    turn2 = [
        t
        for t, _, _ in speculative_generate_step(
            mx.array([9, 10]), model, drafter, max_tokens=12, prompt_cache=cache
        )
    ]
    fresh = [
        t
        for t, _ in generate_step(
            mx.array(PROMPT + turn1 + [9, 10]), model, max_tokens=12
        )
    ]
    assert turn2 == fresh


@given(
    prompt=st.lists(st.integers(5, 511), min_size=1, max_size=12),
    penalty=st.sampled_from([1.2, 2.0]),
    bias=st.dictionaries(st.integers(5, 511), st.floats(-5, 5), max_size=3),
    max_tokens=st.integers(1, 40),
    parked=st.booleans(),
)
# A bias only the penalty holds back: a round that misses its anchor in the
# penalty's context repeats it (7, 9, then 9 again).
@example(prompt=[5, 6], penalty=100.0, bias={7: 30.0, 9: 29.0}, max_tokens=6, parked=True)
def test_greedy_with_logits_processors_is_lossless(prompt, penalty, bias, max_tokens, parked):
    """At temperature 0 the processors apply to every verified position
    exactly as in mlx-lm's generate_step, drafting or parked (where each
    round is built before the one before it is read)."""
    model, drafter = tiny()
    processors = make_logits_processors(
        logit_bias=bias or None, repetition_penalty=penalty
    )
    # Drafting never pays on these costs: parked from the first round.
    scheduler = TableCostScheduler(None, 0.05, [0.01] + [0.05] * 15) if parked else None
    ours = [
        t
        for t, _, _ in speculative_generate_step(
            mx.array(prompt),
            model,
            drafter,
            max_tokens=max_tokens,
            logits_processors=processors,
            scheduler=scheduler,
        )
    ]
    plain = [
        t
        for t, _ in generate_step(
            mx.array(prompt), model, max_tokens=max_tokens, logits_processors=processors
        )
    ]
    assert ours == plain


def test_all_settings_combinations_run():
    """Every mlx-lm sampler setting is accepted (XTC falls back to matching)."""
    for temp, top_p, top_k, xtc in itertools.product(
        [0.5], [0.0, 0.9], [0, 5], [0.0, 0.5]
    ):
        sampler = make_sampler(temp, top_p=top_p, top_k=top_k, xtc_probability=xtc)
        responses, stats = run_tokens(sampler, seed=1, max_tokens=8)
        assert len(responses) == 8
        assert stats.acceptance_rule == ("match" if xtc else "rejection")
