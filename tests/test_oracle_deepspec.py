"""Token-exact parity with DeepSpec's own decode loop (float32 oracle traces),
for the Gemma-4 and the Qwen3 families."""

import functools
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

import mlx_dspark
from mlx_dspark import SpeculativeStats, speculative_generate_step
from mlx_dspark.plugins import find_target_adapter

from conftest import FIXTURES

FAMILIES = {
    "gemma4": FIXTURES / "deepspec-tiny",
    "qwen3": FIXTURES / "deepspec-qwen3-tiny",
}
TRACES = {
    family: json.loads((path / "oracle_traces_float32_T0.json").read_text())
    for family, path in FAMILIES.items()
}
CASES = [
    (family, r["variant"], r["confidence_threshold"])
    for family, traces in TRACES.items()
    for r in traces["runs"]
]
MAX_NEW = 40
assert all(t["meta"]["max_new_tokens"] == MAX_NEW for t in TRACES.values())


def run_of(family, variant, threshold):
    return next(
        r
        for r in TRACES[family]["runs"]
        if (r["variant"], r["confidence_threshold"]) == (variant, threshold)
    )


@functools.lru_cache(maxsize=None)
def target(family):
    model, _ = load(str(FAMILIES[family] / f"target_tiny_{family}"))
    return model


def drafter_for(family, variant, threshold=0.0):
    """The drafter with DeepSpec's rounds: every draft verified, or up to the
    first below the threshold."""
    return mlx_dspark.load_drafter(
        FAMILIES[family] / f"{variant}_tiny_{family}_block4",
        confidence_threshold=threshold,
        scheduler="fixed" if threshold == 0 else None,
    )


def decode(model, drafter, prompt_ids, max_tokens):
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    tokens = [
        t
        for t, _, _ in speculative_generate_step(
            mx.array(prompt_ids), model, drafter, max_tokens=max_tokens, stats=stats
        )
    ]
    return tokens, stats


@pytest.mark.parametrize("family,variant,threshold", CASES)
def test_every_round_matches_deepspec(family, variant, threshold):
    """Each round's drafted block, verified length, accepted drafts, target
    token and confidence logits equal the reference's, for every sample."""
    drafter = drafter_for(family, variant, threshold)
    for sample in run_of(family, variant, threshold)["samples"]:
        # Decode past max_new_tokens: the reference runs its last rounds to
        # completion, and we want to compare every one of them.
        tokens, stats = decode(
            target(family), drafter, sample["prompt_ids"], MAX_NEW + 8
        )
        assert tokens[0] == sample["first_token_from_prefill"]
        assert len(stats.history) >= len(sample["rounds"])
        for ours, ref in zip(stats.history, sample["rounds"]):
            assert ours.start == ref["start"]
            assert ours.anchor == ref["anchor"]
            assert ours.drafts == ref["block_tokens"]
            assert ours.proposed == ref["proposal_len"]
            assert ours.accepted == ref["accepted_draft_tokens"]
            assert ours.next_token == ref["next_token"]
            if variant == "dspark":
                np.testing.assert_allclose(
                    ours.confidence, ref["confidence_logits"], atol=1e-4
                )
            else:
                assert ours.confidence is None


@pytest.mark.parametrize("family,variant,threshold", CASES)
def test_outputs_and_acceptance_lengths_match_deepspec(family, variant, threshold):
    drafter = drafter_for(family, variant, threshold)
    for sample in run_of(family, variant, threshold)["samples"]:
        tokens, stats = decode(target(family), drafter, sample["prompt_ids"], MAX_NEW)
        assert tokens == sample["generated_ids"]
        assert tokens == sample["target_greedy_reference"]
        # Near the end we draft no more than can still be emitted (and skip
        # the extra round the reference runs when the budget is used up
        # exactly); every round before that matches.
        full_block = [r for r in stats.history if len(r.drafts) == drafter.block_size]
        ref = sample["acceptance_lengths"]
        assert [r.acceptance_length for r in full_block] == ref[: len(full_block)]


def round0(family, variant, threshold):
    name = f"round0_tensors_{variant}_thr{threshold}_float32_T0.safetensors"
    return mx.load(str(FAMILIES[family] / name))


@pytest.mark.parametrize("family", FAMILIES)
def test_target_taps_match_reference_prefill_features(family):
    """The tapped forward returns the raw outputs of layers 1, 2, 4 (for
    Gemma-4 after layer_scalar; before the final norm) exactly as DeepSpec
    captures them."""
    sample = run_of(family, "dspark", 0.0)["samples"][0]
    model = target(family)
    tapped = find_target_adapter(model).adapt(model)
    out = tapped(mx.array(sample["prompt_ids"])[None], tapped.make_cache(5), (1, 2, 4))
    features = mx.concatenate(out.hidden, axis=-1)[0]
    expected = round0(family, "dspark", 0.0)["prefill_target_features"]
    np.testing.assert_allclose(np.array(features), np.array(expected), atol=1e-5)
    assert mx.argmax(out.logits[0, -1]).item() == sample["first_token_from_prefill"]


@pytest.mark.parametrize("family,variant,threshold", CASES)
def test_round0_tensors(family, variant, threshold):
    """Unit parity of the first round's context projection, block hidden,
    base logits (soft-capped for Gemma-4), Markov-corrected logits and
    confidence logits."""
    ref = round0(family, variant, threshold)
    sample = run_of(family, variant, threshold)["samples"][0]
    drafter = drafter_for(family, variant, threshold)
    model = drafter.model
    features = ref["round0_new_context_raw_target_features"][None]

    context = model.hidden_norm(model.fc(features))[0]
    np.testing.assert_allclose(
        np.array(context),
        np.array(ref["round0_context_features_after_fc_hidden_norm"]),
        atol=1e-5,
    )

    cache = drafter.make_cache()
    drafter.commit(cache, [features])
    anchor = mx.array(sample["rounds"][0]["anchor"])
    block = mx.concatenate([anchor.reshape(1).astype(mx.uint32), drafter._masks])[None]
    hidden = model(block, cache)
    np.testing.assert_allclose(
        np.array(hidden[0]),
        np.array(ref["round0_block_hidden_after_final_norm"]),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        np.array(model.compute_logits(hidden)[0]),
        np.array(ref["round0_base_logits_softcapped"]),
        atol=1e-4,
    )
    proposal = drafter.propose(cache, anchor, drafter.block_size)
    assert proposal.tokens.tolist() == sample["rounds"][0]["block_tokens"]
    np.testing.assert_allclose(
        np.array(proposal.logits),
        np.array(ref["round0_markov_corrected_logits"]),
        atol=1e-4,
    )
    if variant == "dspark":
        np.testing.assert_allclose(
            np.array(proposal.confidence),
            np.array(ref["round0_confidence_logits"]),
            atol=1e-4,
        )
    assert cache[0].offset == len(sample["prompt_ids"]), (
        "propose must not grow the cache"
    )


@pytest.mark.parametrize("family,variant,threshold", CASES)
def test_drafter_replay_without_target(family, variant, threshold):
    """Fed the reference's context features round by round, the drafter alone
    reproduces every block, confidence and cache length."""
    name = "replay_context_features_float32_T0.safetensors"
    replay = mx.load(str(FAMILIES[family] / name))
    drafter = drafter_for(family, variant, threshold)
    for s, sample in enumerate(run_of(family, variant, threshold)["samples"]):
        cache = drafter.make_cache()
        for r, rnd in enumerate(sample["rounds"]):
            assert cache[0].offset == rnd["draft_cache_len_before"]
            features = replay[
                f"{variant}_thr{threshold}_s{s}_r{r}_new_context_raw_target_features"
            ]
            lo, hi = rnd["new_context_positions"]
            assert features.shape[0] == hi - lo
            drafter.commit(cache, [features[None]])
            assert cache[0].offset == rnd["draft_cache_len_after"] == rnd["start"]
            proposal = drafter.propose(
                cache, mx.array(rnd["anchor"]), drafter.block_size
            )
            assert proposal.tokens.tolist() == rnd["block_tokens"]
            if proposal.confidence is not None:
                np.testing.assert_allclose(
                    np.array(proposal.confidence), rnd["confidence_logits"], atol=1e-4
                )


@pytest.mark.parametrize("family,variant,threshold", CASES)
def test_acceptance_by_position_is_deepspecs_accept_rate(family, variant, threshold):
    """``acceptance_by_position[k]`` is DeepSpec's ``accept_rate@k``: rounds
    with more than k accepted drafts over rounds that verified more than k,
    computed here from the reference's own per-round lengths."""
    drafter = drafter_for(family, variant, threshold)
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    proposed, accepted = [], []
    for sample in run_of(family, variant, threshold)["samples"]:
        _, one = decode(target(family), drafter, sample["prompt_ids"], MAX_NEW + 8)
        rounds = len(sample["rounds"])
        stats.history += one.history[:rounds]
        proposed += sample["proposal_lengths"]
        accepted += sample["accepted_draft_lengths"]
    for k, rate in enumerate(stats.acceptance_by_position):
        verified = [a for p, a in zip(proposed, accepted) if p > k]
        expected = sum(a > k for a in verified) / len(verified) if verified else None
        assert rate == pytest.approx(expected)
    assert stats.tau == pytest.approx(sum(a + 1 for a in accepted) / len(accepted))
