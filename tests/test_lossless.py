"""Losslessness: speculative output == the target's own greedy output."""

import functools
from dataclasses import dataclass

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm import load

import mlx_dspark
from mlx_dspark import speculative_generate_step
from mlx_dspark.drafters.base import Proposal

from conftest import FIXTURES
from tiny import (
    gemma4_text_args,
    plain_greedy,
    qwen3_args,
    speculative,
    tiny_dspark,
    tiny_gemma4,
    tiny_qwen3,
    tiny_qwen3_dspark,
)

FAMILIES = {"gemma4": "deepspec-tiny", "qwen3": "deepspec-qwen3-tiny"}


@functools.lru_cache(maxsize=None)
def trained(family, variant="dspark", threshold=0.0):
    """The bundled trained tiny target of ``family`` and one of its drafters."""
    path = FIXTURES / FAMILIES[family]
    model, _ = load(str(path / f"target_tiny_{family}"))
    drafter = mlx_dspark.load_drafter(
        path / f"{variant}_tiny_{family}_block4", confidence_threshold=threshold
    )
    return model, drafter


@pytest.mark.parametrize("family", FAMILIES)
@given(
    prompt=st.lists(st.integers(5, 511), min_size=1, max_size=30),
    variant=st.sampled_from(["dspark", "dflash"]),
    threshold=st.sampled_from([0.0, 0.3, 0.6, 0.9]),
    num_draft_tokens=st.integers(1, 4),
    max_tokens=st.integers(1, 64),
    prefill_step_size=st.sampled_from([1, 3, 2048]),
)
def test_trained_pairs_are_lossless(
    family, prompt, variant, threshold, num_draft_tokens, max_tokens, prefill_step_size
):
    """The trained tiny pairs over random prompts, block sizes and thresholds;
    for Gemma-4 (window 8) at lengths that cross the window several times."""
    if variant == "dflash":
        threshold = 0.0
    model, drafter = trained(family, variant, threshold)
    ours, stats = speculative(
        model,
        drafter,
        prompt,
        max_tokens,
        num_draft_tokens=num_draft_tokens,
        prefill_step_size=prefill_step_size,
    )
    assert ours == plain_greedy(model, prompt, max_tokens)
    assert all(r.proposed <= num_draft_tokens for r in stats.history)


def random_drafter_kwargs(draw, layers):
    """A random drafter's options for a target of ``layers`` layers: block
    size, taps (the embedding included), Markov head, confidence head."""
    taps = sorted(draw(st.sets(st.integers(-1, layers - 2), min_size=1, max_size=3)))
    rank = draw(st.sampled_from([0, 4, 8]))
    return dict(
        block_size=draw(st.integers(1, 6)),
        taps=taps,
        markov_rank=rank,
        markov_head_type=draw(st.sampled_from(["vanilla", "gated", "rnn"])),
        confidence=draw(st.booleans()),
        layers=draw(st.integers(1, 2)),
    )


@st.composite
def random_qwen3_pairs(draw):
    layers = draw(st.integers(2, 5))
    target_kwargs = dict(layers=layers, tie=draw(st.booleans()))
    drafter_kwargs = random_drafter_kwargs(draw, layers)
    seed = draw(st.integers(0, 10_000))
    prompt = draw(st.lists(st.integers(0, 95), min_size=1, max_size=20))
    return target_kwargs, drafter_kwargs, seed, prompt, draw(st.integers(1, 40))


@given(random_qwen3_pairs())
def test_random_qwen3_models_are_lossless(case):
    target_kwargs, drafter_kwargs, seed, prompt, max_tokens = case
    model = tiny_qwen3(seed=seed, **target_kwargs)
    drafter = tiny_qwen3_dspark(
        qwen3_args(**target_kwargs), seed=seed + 1, **drafter_kwargs
    )
    ours, _ = speculative(model, drafter, prompt, max_tokens)
    assert ours == plain_greedy(model, prompt, max_tokens)


@st.composite
def random_pairs(draw):
    layers = draw(st.integers(2, 5))
    target_kwargs = dict(
        layers=layers,
        window=draw(st.integers(2, 6)),
        k_eq_v=draw(st.booleans()),
        wrapper=draw(st.booleans()),
    )
    if draw(st.booleans()):
        target_kwargs.update(
            per_layer_input=8, kv_shared=draw(st.integers(0, layers - 2))
        )
    drafter_kwargs = random_drafter_kwargs(draw, layers)
    if drafter_kwargs["confidence"]:
        drafter_kwargs["confidence_threshold"] = draw(st.sampled_from([0.0, 0.5]))
    seed = draw(st.integers(0, 10_000))
    prompt = draw(st.lists(st.integers(0, 95), min_size=1, max_size=20))
    return target_kwargs, drafter_kwargs, seed, prompt, draw(st.integers(1, 40))


@given(random_pairs())
def test_random_models_are_lossless(case):
    """Random targets (dense, per-layer inputs, KV sharing, the gemma4
    wrapper; tiny windows) with random DSpark/DFlash drafters (every Markov
    head type, confidence threshold, taps including the embedding)."""
    target_kwargs, drafter_kwargs, seed, prompt, max_tokens = case
    model = tiny_gemma4(seed=seed, **target_kwargs)
    args = gemma4_text_args(
        **{k: v for k, v in target_kwargs.items() if k != "wrapper"}
    )
    drafter = tiny_dspark(args, seed=seed + 1, **drafter_kwargs)
    ours, _ = speculative(model, drafter, prompt, max_tokens)
    assert ours == plain_greedy(model, prompt, max_tokens)


@dataclass
class Counter:
    """Drafter state of the scripted drafter: just the committed length."""

    offset: int = 0

    def trim(self, n):
        self.offset -= n
        return n

    def is_trimmable(self):
        return True

    @property
    def state(self):
        return []


class ScriptedDrafter:
    """Proposes the target's true continuation with scripted corruptions, so
    every acceptance length (0..k) and rollback depth occurs."""

    name = "scripted"
    taps = (0,)

    def __init__(self, continuation, corruptions, block_size):
        self.continuation = continuation
        self.corruptions = corruptions
        self.block_size = self.max_draft_tokens = block_size
        self.round = 0

    def check_target(self, target):
        pass

    def make_cache(self):
        return [Counter()]

    def commit(self, cache, hidden, proposal=None):
        cache[0].offset += hidden[0].shape[1]

    def propose(
        self, cache, anchor, num_drafts, draw=None, target=None, target_cache=None
    ):
        position = cache[0].offset + 1 - self.prompt_length
        drafts = list(self.continuation[position : position + num_drafts])
        drafts += [0] * (num_drafts - len(drafts))
        wrong_at = self.corruptions[self.round % len(self.corruptions)]
        if wrong_at < num_drafts:
            drafts[wrong_at] = (drafts[wrong_at] + 1) % 96
        self.round += 1
        return Proposal(tokens=mx.array(drafts, mx.uint32))


TINY_TARGETS = {
    "gemma4": lambda seed: tiny_gemma4(seed=seed, window=3),
    "qwen3": lambda seed: tiny_qwen3(seed=seed),
}


@pytest.mark.parametrize("family", TINY_TARGETS)
@given(
    seed=st.integers(0, 1000),
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=10),
    block_size=st.integers(1, 6),
    corruptions=st.lists(st.integers(0, 7), min_size=1, max_size=8),
    max_tokens=st.integers(1, 40),
)
def test_any_draft_is_accepted_exactly_as_far_as_it_is_right(
    family, seed, prompt, block_size, corruptions, max_tokens
):
    model = TINY_TARGETS[family](seed)
    reference = plain_greedy(model, prompt, max_tokens + block_size + 1)
    drafter = ScriptedDrafter(reference, corruptions, block_size)
    drafter.prompt_length = len(prompt)
    ours, stats = speculative(model, drafter, prompt, max_tokens)
    assert ours == reference[:max_tokens]
    for r, corrupt in zip(stats.history, corruptions * len(stats.history)):
        assert r.accepted == min(corrupt, r.proposed)


@pytest.mark.parametrize("max_tokens", range(1, 13))
def test_rounds_at_the_end_of_the_budget(max_tokens):
    """With drafts that are always right, every round keeps all its drafts
    and the target's bonus token after them, and drafts no more than what
    can still be emitted besides that token."""
    model = TINY_TARGETS["gemma4"](0)
    prompt = [3, 14, 15]
    reference = plain_greedy(model, prompt, max_tokens + 6)
    drafter = ScriptedDrafter(reference, [99], 4)
    drafter.prompt_length = len(prompt)
    ours, stats = speculative(model, drafter, prompt, max_tokens)
    assert ours == reference[:max_tokens]
    emitted = 1
    for r in stats.history:
        assert r.proposed == len(r.drafts) == min(4, max_tokens - emitted - 1)
        assert r.accepted == r.proposed
        assert r.next_token == reference[emitted + r.accepted]
        emitted += r.accepted + 1
    assert emitted == max_tokens


@given(
    seed=st.integers(0, 1000),
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=10),
    stop_at=st.integers(1, 25),
    block_size=st.integers(2, 6),
)
def test_stop_token_inside_accepted_drafts_ends_the_round_there(
    seed, prompt, stop_at, block_size
):
    """A stop token among the accepted drafts ends generation at it, and the
    round counts only the drafts up to it (no target token), as in DeepSpec."""
    model = tiny_gemma4(seed=seed, window=3)
    reference = plain_greedy(model, prompt, 40)
    stop = reference[stop_at]
    expected = reference[: reference.index(stop) + 1]
    drafter = ScriptedDrafter(reference, [99], block_size)
    drafter.prompt_length = len(prompt)
    ours, stats = speculative(model, drafter, prompt, 40, stop_tokens=[stop])
    assert ours == expected
    last = stats.history[-1] if stats.history else None
    if last is not None and last.next_token is None:
        assert expected[-1] in last.drafts[: last.accepted]
        assert last.acceptance_length == last.accepted == last.proposed
    # Every token came from a draft or a round's target token.
    assert 1 + sum(r.acceptance_length for r in stats.history) >= len(ours)


@pytest.mark.parametrize("wrong_at", [99, 2])
def test_stop_token_round_statistics(tiny_pair, wrong_at):
    """A stop token at the second draft (followed by right drafts, or the
    last one accepted before a wrong one): the round verified and accepted
    exactly two drafts and has no target token."""
    model = tiny_pair[0]
    prompt = [65, 211, 266, 241, 234]
    reference = plain_greedy(model, prompt, 12)
    # The first round drafts reference[1:5]; make reference[2] the stop token.
    assert len(set(reference[:6])) == 6, "the fixture's continuation repeats"
    drafter = ScriptedDrafter(reference, [wrong_at], 4)
    drafter.prompt_length = len(prompt)
    ours, stats = speculative(model, drafter, prompt, 12, stop_tokens=[reference[2]])
    assert ours == reference[:3]
    (only,) = stats.history
    assert (only.proposed, only.accepted, only.next_token) == (2, 2, None)
    assert stats.acceptance_lengths == [2]


@pytest.mark.parametrize("family", FAMILIES)
@given(
    prompt=st.lists(st.integers(5, 511), min_size=1, max_size=12),
    follow_up=st.lists(st.integers(5, 511), min_size=1, max_size=12),
    first=st.integers(1, 30),
    second=st.integers(1, 30),
)
def test_prompt_cache_continues_exactly(family, prompt, follow_up, first, second):
    """A second turn on the prompt cache (holding the prompt and every
    yielded token, target and drafter alike) equals a fresh run over the
    whole conversation."""
    model, drafter = trained(family)
    cache = mlx_dspark.make_prompt_cache(model, drafter)
    turn1, _ = speculative(model, drafter, prompt, first, prompt_cache=cache)
    assert cache[0].offset == cache[-1].offset == len(prompt) + len(turn1)
    turn2, _ = speculative(model, drafter, follow_up, second, prompt_cache=cache)
    assert turn2 == plain_greedy(model, prompt + turn1 + follow_up, second)


def test_stats_follow_deepspec_definitions(tiny_pair):
    model, _, drafter = tiny_pair
    _, stats = speculative(model, drafter, [10, 20, 30], 30)
    assert stats.rounds == len(stats.history) > 0
    assert stats.drafted == sum(r.proposed for r in stats.history)
    assert stats.tau == sum(r.accepted + 1 for r in stats.history) / stats.rounds
    rates = stats.acceptance_by_position
    assert len(rates) == drafter.block_size
    assert all(
        a >= b for a, b in zip(rates, rates[1:]) if a is not None and b is not None
    )


@given(
    prompt=st.lists(st.integers(5, 511), min_size=1, max_size=12),
    follow_up=st.lists(st.integers(5, 511), min_size=1, max_size=8),
    stop_after=st.integers(1, 25),
    how=st.sampled_from(["eos", "max_tokens", "close"]),
)
def test_prompt_cache_after_stopping_early(
    tiny_pair, prompt, follow_up, stop_after, how
):
    """However generation ends (EOS, max_tokens, or the consumer closing the
    stream), the prompt cache holds exactly the prompt and the tokens the
    consumer received, so the next turn equals a fresh run."""
    import copy

    model, tokenizer, drafter = tiny_pair
    reference = plain_greedy(model, prompt, stop_after)
    tokenizer = copy.deepcopy(tokenizer)
    if how == "eos":
        tokenizer.eos_token_ids = {reference[-1]}
    cache = mlx_dspark.make_prompt_cache(model, drafter)
    stream = mlx_dspark.stream_generate(
        model,
        tokenizer,
        prompt,
        draft=drafter,
        max_tokens=stop_after if how == "max_tokens" else 100,
        prompt_cache=cache,
    )
    received = []
    for response in stream:
        received.append(response.token)
        if how == "close" and len(received) == stop_after:
            stream.close()
            break
    assert received == reference[: len(received)]
    assert cache[0].offset == cache[-1].offset == len(prompt) + len(received)
    turn2, _ = speculative(model, drafter, follow_up, 12, prompt_cache=cache)
    assert turn2 == plain_greedy(model, prompt + received + follow_up, 12)


def test_interrupted_round_leaves_a_consistent_cache(tiny_pair):
    """An exception between the verify forward and the drafter's commit
    (say Ctrl-C) still leaves target and drafter caches in step. (Every
    round drafts: under ``cost`` a stream that parks on this machine's
    costs commits less often, and the fourth commit can be the cleanup's.)"""
    model, _, drafter = tiny_pair
    prompt = [65, 211, 266, 241]

    class Interrupting:
        def __init__(self, inner, after):
            self.inner, self.after = inner, after
            self.commits = 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def commit(self, cache, hidden, proposal=None):
            self.commits += 1
            if self.commits == self.after:
                raise KeyboardInterrupt
            self.inner.commit(cache, hidden, proposal)

    flaky = Interrupting(drafter, after=4)
    cache = mlx_dspark.make_prompt_cache(model, drafter)
    received = []
    try:
        for token, _, _ in speculative_generate_step(
            mx.array(prompt), model, flaky, max_tokens=50, prompt_cache=cache,
            scheduler="fixed",
        ):
            received.append(token)
    except KeyboardInterrupt:
        pass
    assert len(received) > 1
    assert cache[0].offset == cache[-1].offset == len(prompt) + len(received)
    turn2, _ = speculative(model, drafter, [7], 10, prompt_cache=cache)
    assert turn2 == plain_greedy(model, prompt + received + [7], 10)


def test_max_tokens_zero_yields_nothing(tiny_pair):
    model, _, drafter = tiny_pair
    assert speculative(model, drafter, [1, 2, 3], 0)[0] == []


@pytest.mark.parametrize("dtype", ["bfloat16", "quantized"])
def test_lower_precision_drafters_stay_lossless(dtype):
    """Drafter precision changes acceptance, never the output."""
    import mlx.nn as nn

    model, _ = load(str(FIXTURES / "deepspec-tiny" / "target_tiny_gemma4"))
    path = FIXTURES / "deepspec-tiny" / "dspark_tiny_gemma4_block4"
    if dtype == "quantized":
        drafter = mlx_dspark.load_drafter(path)
        nn.quantize(
            drafter.model,
            group_size=32,
            bits=4,
            class_predicate=lambda _, m: (
                hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0
            ),
        )
    else:
        drafter = mlx_dspark.load_drafter(path, dtype=dtype)
    for prompt in ([65, 211, 266, 241, 234], [9, 8, 7]):
        ours, stats = speculative(model, drafter, prompt, 40)
        assert ours == plain_greedy(model, prompt, 40)
        assert stats.accepted > 0
