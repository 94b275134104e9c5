"""The confidence head at work: STS calibration (paper §3.2.1), the verify
schedulers (Algorithm 1 and its causal early stop, Appendix A), and the
engine under any schedule."""

import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlx_lm import load

import mlx_dspark
from mlx_dspark import SpeculativeStats
from mlx_dspark.confidence.calibration import (
    GRID,
    Calibration,
    Rounds,
    auroc,
    default_calibration_path,
    drafter_fingerprint,
    expected_calibration_error,
    fit_sts,
    metrics,
    predictions,
    sigmoid,
    survival,
)
from mlx_dspark.confidence import costs as costs_module
from mlx_dspark.confidence.costs import CostProfile, RoundCosts, depth_bucket
from mlx_dspark.confidence.schedulers import (
    CostScheduler,
    ThresholdScheduler,
    prefix_schedule,
    scheduler_for,
)
from mlx_dspark.speculative.acceptance import rejection_accept

from chisquare import goodness_of_fit
from conftest import DEEPSPEC_TINY
from tiny import Clock, gemma4_text_args, plain_greedy, speculative, tiny_dspark, tiny_gemma4

DSPARK = DEEPSPEC_TINY / "dspark_tiny_gemma4_block4"
DFLASH = DEEPSPEC_TINY / "dflash_tiny_gemma4_block4"
TARGET = DEEPSPEC_TINY / "target_tiny_gemma4"
ALPHA = 1e-4
BIN = Path(sys.executable).parent
SHIPPED = Path(__file__).parent.parent / "examples" / "calibration"


@st.composite
def verified_rounds(draw, max_block=5):
    """Rounds with random confidence logits and prefix outcomes."""
    block = draw(st.integers(1, max_block))
    count = draw(st.integers(2, 60))
    logits = draw(
        st.lists(
            st.lists(st.floats(-8, 8), min_size=block, max_size=block),
            min_size=count,
            max_size=count,
        )
    )
    verified = draw(st.lists(st.integers(0, block), min_size=count, max_size=count))
    accepted = [draw(st.integers(0, v)) for v in verified]
    return Rounds(np.array(logits), np.array(verified), np.array(accepted))


# -- metrics ------------------------------------------------------------------


@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=1, max_size=200))
def test_ece_is_the_bin_weighted_gap_between_confidence_and_accuracy(pairs):
    predicted = np.array([p for p, _ in pairs])
    labels = np.array([float(y) for _, y in pairs])
    expected = 0.0
    for b in range(20):
        members = [
            (p, y) for p, y in zip(predicted, labels) if min(int(p * 20), 19) == b
        ]
        if members:
            gap = np.mean([p for p, _ in members]) - np.mean([y for _, y in members])
            expected += len(members) / len(pairs) * abs(gap)
    assert expected_calibration_error(predicted, labels)[0] == pytest.approx(expected)


@given(
    st.lists(
        st.tuples(st.sampled_from([0.1, 0.3, 0.5, 0.9]), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_auroc_is_the_chance_a_positive_outranks_a_negative(pairs):
    predicted = np.array([p for p, _ in pairs])
    labels = np.array([float(y) for _, y in pairs])
    positives = [p for p, y in pairs if y]
    negatives = [p for p, y in pairs if not y]
    if not positives or not negatives:
        assert auroc(predicted, labels) is None
        return
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    expected = wins / (len(positives) * len(negatives))
    assert auroc(predicted, labels) == pytest.approx(expected)


# -- STS ----------------------------------------------------------------------


@given(
    st.lists(st.floats(-20, 20), min_size=2, max_size=30),
    st.sampled_from(list(GRID)),
)
def test_temperature_scaling_preserves_order_within_a_position(logits, temperature):
    scaled = sigmoid(np.array(logits) / temperature)
    for i, j in zip(np.argsort(logits)[:-1], np.argsort(logits)[1:]):
        assert scaled[i] <= scaled[j]


@given(
    st.lists(st.floats(-30, 30), min_size=1, max_size=8),
    st.lists(st.sampled_from(list(GRID)), min_size=8, max_size=8),
)
def test_calibrated_survival_never_increases_with_position(logits, temperatures):
    a = survival(logits, temperatures)
    assert all(0 <= later <= earlier <= 1 for earlier, later in zip(a, a[1:]))


@given(verified_rounds())
def test_fitted_temperatures_stay_within_the_grid(rounds):
    temperatures = fit_sts(rounds, min_rounds=1)
    assert len(temperatures) == rounds.logits.shape[1]
    assert all(GRID[0] <= t <= GRID[-1] for t in temperatures)
    assert all(t in GRID or t == 1.0 for t in temperatures)


@given(verified_rounds())
def test_each_fitted_temperature_lowers_its_positions_ece(rounds):
    """At each position the fitted temperature is no worse than leaving that
    position unscaled (the earlier positions' temperatures fixed), so at the
    first position the fitted ECE is at most the uncalibrated one. (Beyond
    the first, left-to-right STS does not promise that: the prefix product
    there already carries the earlier positions' temperatures.)"""
    temperatures = fit_sts(rounds, min_rounds=1)
    fitted = metrics(rounds, temperatures)
    for m in fitted:
        k = m["position"]
        unscaled = temperatures[: k - 1] + [1.0] * (len(temperatures) - k + 1)
        assert m["ece"] <= metrics(rounds, unscaled)[k - 1]["ece"] + 1e-12
    if fitted:
        raw = metrics(rounds, [1.0] * len(temperatures))
        assert fitted[0]["ece"] <= raw[0]["ece"] + 1e-12


def overconfident_rounds(true_temperature=3.0, count=20_000, block=3, seed=0):
    """Rounds from a head whose true conditionals are ``σ(z / 3)``."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, size=(count, block))
    survives = rng.random((count, block)) < sigmoid(logits / true_temperature)
    accepted = np.cumprod(survives, axis=1).sum(axis=1)
    return Rounds(logits, np.full(count, block), accepted)


def test_sts_recovers_the_temperature_of_an_overconfident_head():
    rounds = overconfident_rounds()
    temperatures = fit_sts(rounds)
    assert temperatures[:2] == pytest.approx([3.0, 3.0], rel=0.15)
    before = metrics(rounds, [1.0] * 3)
    after = metrics(rounds, temperatures)
    for b, a in zip(before, after):
        assert a["ece"] < 0.02 < b["ece"]
        assert a["brier"] < b["brier"]
        assert a["auroc"] == pytest.approx(b["auroc"], abs=0.02)


def test_each_position_gets_its_own_temperature():
    """A head overconfident by a different factor at each position: the fit
    recovers each one, and survival and predictions apply ``T_k`` to the
    ``k``-th logit."""
    true = [0.5, 3.0, 1.5]
    rng = np.random.default_rng(1)
    logits = rng.normal(0.0, 3.0, size=(20_000, 3))
    survives = rng.random(logits.shape) < sigmoid(logits / np.array(true))
    rounds = Rounds(logits, np.full(len(logits), 3), np.cumprod(survives, 1).sum(1))
    assert fit_sts(rounds) == pytest.approx(true, rel=0.15)
    expected = np.cumprod(sigmoid(logits[:2] / np.array(true)), axis=1)
    np.testing.assert_allclose(predictions(rounds.take(slice(0, 2)), true), expected)
    np.testing.assert_allclose(survival(logits[0], true), expected[0])
    np.testing.assert_allclose(survival(logits[0, :2], true), expected[0, :2])


def test_positions_with_few_rounds_keep_their_temperature():
    rounds = overconfident_rounds(count=400)
    rounds.verified[15:] = 1  # position 2 verified in 15 rounds only
    rounds.accepted = np.minimum(rounds.accepted, rounds.verified)
    temperatures = fit_sts(rounds)
    assert temperatures[0] != 1.0 and temperatures[1:] == [1.0, 1.0]


def test_a_retrained_checkpoint_gets_another_fingerprint(tmp_path):
    """Same config, same file sizes, different weights."""
    copy = tmp_path / "dspark"
    shutil.copytree(DSPARK, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(reversed(data[middle : middle + 64]))
    weights.write_bytes(bytes(data))
    assert drafter_fingerprint(copy) != drafter_fingerprint(DSPARK)
    assert drafter_fingerprint(DSPARK) == drafter_fingerprint(DSPARK)


def test_calibration_files_round_trip_and_refuse_other_drafters(tmp_path):
    path = tmp_path / "cal.json"
    Calibration([1.5, 2.0, 0.7, 1.0], drafter="abc", rounds=10).save(path)
    assert Calibration.load(path, "abc", 4).temperatures == [1.5, 2.0, 0.7, 1.0]
    with pytest.raises(ValueError, match="made for another drafter"):
        Calibration.load(path, "xyz", 4)
    with pytest.raises(ValueError, match="needs 7 positive temperatures"):
        Calibration.load(path, "abc", 7)
    with pytest.raises(ValueError, match="No calibration file"):
        Calibration.load(tmp_path / "missing.json", "abc", 4)
    (tmp_path / "other.json").write_text(json.dumps({"temperatures": [1]}))
    with pytest.raises(ValueError, match="not an mlx-dspark calibration file"):
        Calibration.load(tmp_path / "other.json", "abc", 1)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot be read"):
        Calibration.load(tmp_path / "bad.json", "abc", 1)
    for temperatures in (5, [1.0, float("inf")], [1.0, -2.0], ["1", 1.0]):
        (tmp_path / "odd.json").write_text(
            json.dumps(
                {
                    "format": "mlx-dspark-sts/1",
                    "temperatures": temperatures,
                    "drafter": "abc",
                }
            )
        )
        with pytest.raises(ValueError, match="needs 2 positive temperatures"):
            Calibration.load(tmp_path / "odd.json", "abc", 2)


def test_loading_picks_up_the_saved_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    assert mlx_dspark.load_drafter(DSPARK).calibration is None
    fingerprint = drafter_fingerprint(DSPARK)
    Calibration([2.0, 1.0, 0.5, 1.0], drafter=fingerprint).save(
        default_calibration_path(fingerprint)
    )
    assert mlx_dspark.load_drafter(DSPARK).calibration.temperatures[0] == 2.0
    assert mlx_dspark.load_drafter(DSPARK, calibration=False).calibration is None
    explicit = tmp_path / "explicit.json"
    Calibration([3.0, 1.0, 1.0, 1.0], drafter=fingerprint).save(explicit)
    drafter = mlx_dspark.load_drafter(DSPARK, calibration=explicit)
    assert drafter.calibration.temperatures[0] == 3.0
    with pytest.raises(ValueError, match="takes no calibration"):
        mlx_dspark.load_drafter(DFLASH, calibration=explicit)


def test_a_broken_saved_calibration_is_skipped_with_a_warning(tmp_path, monkeypatch):
    """It must not stop the drafter from loading (nor `calibrate` from
    replacing it); a broken file named explicitly is an error."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    path = default_calibration_path(drafter_fingerprint(DSPARK))
    path.parent.mkdir(parents=True)
    path.write_text("{")
    with pytest.warns(UserWarning, match="Ignoring the saved calibration"):
        assert mlx_dspark.load_drafter(DSPARK).calibration is None
    with pytest.raises(ValueError, match="cannot be read"):
        mlx_dspark.load_drafter(DSPARK, calibration=path)


# -- schedulers -----------------------------------------------------------------


@st.composite
def schedule_cases(draw):
    """Conditionals for one request, a perturbation of those after position
    k, and a verify rate for 1..block+1 tokens."""
    block = draw(st.integers(1, 7))
    conditionals = draw(st.lists(st.floats(0, 1), min_size=block, max_size=block))
    k = draw(st.integers(0, block))
    perturbed = conditionals[:k] + draw(
        st.lists(st.floats(0, 1), min_size=block - k, max_size=block - k)
    )
    rates = draw(st.lists(st.floats(0.05, 2.0), min_size=block + 1, max_size=block + 1))
    return conditionals, perturbed, k, rates


@settings(max_examples=500)  # pure arithmetic, a millisecond each
@given(schedule_cases())
def test_the_decision_to_verify_draft_k_never_looks_at_later_confidences(case):
    """Non-anticipation: whether drafts 1..k are verified depends on the
    confidences up to k only (those after k are computed from draft k on)."""
    conditionals, perturbed, k, rates = case

    def rate(tokens):
        return rates[tokens - 1]

    [length] = prefix_schedule([np.cumprod(conditionals).tolist()], rate)
    [other] = prefix_schedule([np.cumprod(perturbed).tolist()], rate)
    assert min(length, k) == min(other, k)


@given(
    st.lists(
        st.lists(st.floats(0.01, 1), min_size=1, max_size=5), min_size=1, max_size=4
    ),
    st.lists(st.floats(0.05, 2.0), min_size=25, max_size=25),
)
def test_batched_schedule_admits_request_prefixes_by_confidence(requests, rates):
    survival_by_request = [np.cumprod(c).tolist() for c in requests]

    def rate(tokens):
        return rates[tokens - 1]

    lengths = prefix_schedule(survival_by_request, rate)
    admitted = [a for row, n in zip(survival_by_request, lengths) for a in row[:n]]
    refused = [a for row, n in zip(survival_by_request, lengths) for a in row[n:]]
    assert all(0 <= n <= len(row) for row, n in zip(survival_by_request, lengths))
    if admitted and refused:
        assert min(admitted) >= max(refused)
    # The lookahead only goes further than the paper's rule, never less far.
    paper = paper_schedule(survival_by_request, rate)
    assert all(n >= p for n, p in zip(lengths, paper))


def paper_schedule(survival_by_request, rate):
    """The paper's Algorithm 1 as published: drafts admitted by survival
    while each one raises the expected throughput on its own."""
    lengths = [0] * len(survival_by_request)
    tokens, expected = len(lengths), float(len(lengths))
    candidates = sorted(
        (-a, j, r)
        for r, row in enumerate(survival_by_request)
        for j, a in enumerate(row, start=1)
        if a > 0
    )
    for minus_a, j, r in candidates:
        if (expected - minus_a) * rate(tokens + 1) <= expected * rate(tokens):
            break
        lengths[r], tokens, expected = j, tokens + 1, expected - minus_a
    return lengths


@settings(max_examples=300)  # pure arithmetic
@given(
    conditional=st.floats(0.01, 1.0),
    block=st.integers(1, 7),
    rates=st.lists(st.floats(0.05, 2.0), min_size=8, max_size=8),
)
# A dip after the first draft that only all seven drafts climb out of.
@example(conditional=0.9, block=7, rates=[1.0, 1.0, 0.3, 0.3, 0.3, 0.3, 0.3, 0.36])
def test_with_geometric_survival_the_causal_schedule_finds_the_best_prefix(
    conditional, block, rates
):
    """Where every draft survives the one before at the same rate, what
    draft j says of the drafts after it is exact: the causal schedule then
    verifies the prefix with the most expected tokens per second, whatever
    the shape of the verify's costs."""
    survival = [conditional ** (j + 1) for j in range(block)]

    def throughput(n):
        return (1 + sum(survival[:n])) * rates[n]

    [length] = prefix_schedule([survival], lambda tokens: rates[tokens - 1])
    best = max(throughput(n) for n in range(block + 1))
    assert throughput(length) >= best * (1 - 1e-9)


@settings(max_examples=300)  # pure arithmetic
@given(
    conditionals=st.lists(st.floats(0, 1), min_size=7, max_size=7),
    k=st.integers(1, 6),
    later=st.sampled_from(["none survive", "all survive"]),
    one_row=st.floats(0.005, 0.02),
    cliff=st.integers(2, 7),
)
def test_past_a_cost_cliff_the_decision_to_verify_draft_k_still_never_looks_later(
    conditionals, k, later, one_row, cliff
):
    """Non-anticipation where the lookahead matters: a verify of 2 to
    ``cliff`` tokens costs far more than one, and more tokens about what
    one does. Drafts after k changed to the extremes (none of them
    survives, or all do) leave the decision on drafts 1..k alone."""

    def rate(tokens):
        seconds = one_row if tokens == 1 else 0.05 if tokens <= cliff else 1.5 * one_row
        return 1.0 / seconds

    changed = conditionals[:k] + [0.0 if later == "none survive" else 1.0] * (7 - k)
    [length] = prefix_schedule([np.cumprod(conditionals).tolist()], rate)
    [other] = prefix_schedule([np.cumprod(changed).tolist()], rate)
    assert min(length, k) == min(other, k)


# A 4-bit 12B target's verify costs on an H200 (1-16 rows, with a draft).
CLIFF = RoundCosts(
    0.0045,
    [0.010, 0.0232, 0.0295, 0.0393, 0.0433, 0.0501, 0.0561, 0.0292]
    + [0.0293, 0.0295, 0.0298, 0.0300, 0.0302, 0.0303, 0.0304, 0.0306],
)


def test_a_verify_cliff_is_crossed_where_the_drafts_past_it_pay():
    """A 4-bit 12B target on an H200: one row 10 ms, two to seven rows
    23-56 ms, eight and more 29-31 ms; verifies padded to where cheaper.
    Confident drafts (each kept at 0.83) pay at seven and never at one: the
    schedule crosses the cliff where the rule stopping at the first draft
    that does not pay verified none (and the round paid for its drafts for
    nothing)."""
    padded = CLIFF.padded()
    survival = np.cumprod([0.83] * 7).tolist()
    assert prefix_schedule([survival], padded.rounds_per_second) == [7]
    # Drafts nobody believes in stay unverified.
    unsure = np.cumprod([0.15] * 7).tolist()
    assert prefix_schedule([unsure], padded.rounds_per_second) == [0]
    # A confident first draft and then a collapse: the first is verified
    # on what it says of the drafts after it, and the schedule stops at the
    # collapse.
    collapse = np.cumprod([0.9, 0.01, 1.0, 1.0, 1.0, 1.0, 1.0]).tolist()
    assert prefix_schedule([collapse], padded.rounds_per_second) == [1]


def test_prefix_schedule_refuses_survival_that_grows():
    with pytest.raises(ValueError, match="must not increase"):
        prefix_schedule([[0.5, 0.7]], lambda tokens: 1.0)


def retrospective_schedule(survival_by_position, rate):
    """Appendix A's biased alternative: the best prefix over all lengths,
    with no early stop (it looks at confidences of later drafts)."""
    throughput = [
        (1 + sum(survival_by_position[:n])) * rate(1 + n)
        for n in range(len(survival_by_position) + 1)
    ]
    return int(np.argmax(throughput))


APPENDIX_A_RATES = {1: 1.0, 2: 0.5, 3: 0.45}


@pytest.mark.parametrize("c2, causal, retrospective", [(0.9, 2, 2), (0.0, 1, 0)])
def test_appendix_a_causal_scheduler_stops_where_the_retrospective_one_peeks(
    c2, causal, retrospective
):
    """Whether draft 1 is verified: the causal schedule decides it on c1
    alone (and what c1 says of the drafts after it), the retrospective one
    on c2 too."""
    a = [0.8, 0.8 * c2]
    assert prefix_schedule([a], APPENDIX_A_RATES.get) == [causal]
    assert retrospective_schedule(a, APPENDIX_A_RATES.get) == retrospective


def simulate_first_two_tokens(schedule, rates, trials, seed=0):
    """Appendix A's round, many times: target p = (0.7, 0.3) at every
    position, drafts x1, x2 ~ q = (0.5, 0.5), c1 = 0.8 and c2 = 0.9 if
    x1 = A else 0. Verifies the scheduled prefix by rejection sampling and
    returns the counts of the first two tokens emitted (the second drawn
    from the target when the round emits one token, as the next round does).
    """
    rng = random.Random(seed)
    mx.random.seed(seed)
    p = mx.log(mx.array([0.7, 0.3]))
    q = mx.log(mx.array([0.5, 0.5]))
    counts = {}
    for _ in range(trials):
        drafts = [rng.randrange(2), rng.randrange(2)]
        a = [0.8, 0.8 * (0.9 if drafts[0] == 0 else 0.0)]
        n = schedule(a, rates.get)
        accepted, tokens = rejection_accept(
            mx.array(drafts[:n], mx.uint32),
            mx.broadcast_to(q, (n, 2)),
            mx.broadcast_to(p, (n + 1, 2)),
            mx.random.uniform(shape=(n + 1,)),
        )
        emitted = tokens[: accepted.item() + 1].tolist()
        if len(emitted) == 1:
            emitted.append(int(rng.random() >= 0.7))
        key = tuple(emitted[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize(
    "rates",
    # Appendix A's own rates, and rates under which the scheduler verifies
    # x2 exactly when x1 makes c2 high.
    [APPENDIX_A_RATES, {1: 1.0, 2: 0.8, 3: 0.7}],
)
def test_appendix_a_causal_schedule_keeps_the_target_distribution(rates):
    """The first two tokens emitted are i.i.d. from the target."""

    def causal(a, rate):
        return prefix_schedule([a], rate)[0]

    counts = simulate_first_two_tokens(causal, rates, trials=4000)
    joint = {(i, j): [0.7, 0.3][i] * [0.7, 0.3][j] for i in (0, 1) for j in (0, 1)}
    assert goodness_of_fit(counts, joint) > ALPHA


def test_appendix_a_retrospective_schedule_biases_the_output():
    """The counterexample itself: without the early stop, P(first = A) is
    0.85, not the target's 0.7."""
    counts = simulate_first_two_tokens(
        retrospective_schedule, APPENDIX_A_RATES, trials=4000
    )
    first = {0: 0, 1: 0}
    for (i, _), c in counts.items():
        first[i] += c
    assert goodness_of_fit(first, {0: 0.7, 1: 0.3}) < ALPHA
    assert first[0] / 4000 == pytest.approx(0.85, abs=0.03)


def test_threshold_scheduler_verifies_up_to_the_first_unconfident_draft():
    scheduler = ThresholdScheduler(0.5)
    assert scheduler.choose([2.0, 0.1, -0.1, 3.0], 0, None) == 2
    assert scheduler.choose([-1.0, 2.0], 0, None) == 0
    assert scheduler.choose([1.0, 1.0], 0, None) == 2
    # A confidence exactly at the threshold is confident (σ(0) == 0.5).
    assert scheduler.choose([0.0, 0.0, -1e-6], 0, None) == 2


class CountingTimer:
    """A stand-in for the engine's RoundTimer with fixed costs."""

    key = "test"

    def __init__(self, draft, verify):
        self.costs = RoundCosts(draft, verify)
        self.drafts = len(verify) - 1
        self.verify_rows = len(verify)
        self.calls = 0
        self.verified = []  # the verify lengths timed, in order
        self.drafts_timed = 0
        self.repeats = []  # the repeats asked for, call by call

    def __call__(self, tokens=None, draft=True, repeats=costs_module.REPEATS):
        self.calls += 1
        self.repeats.append(repeats)
        tokens = list(range(1, self.verify_rows + 1) if tokens is None else tokens)
        self.verified += tokens
        self.drafts_timed += draft
        return RoundCosts(
            self.costs.draft if draft else 0.0, [self.costs.verify[n - 1] for n in tokens]
        )


def test_cost_profiles_are_measured_once_per_depth_and_kept_on_disk(tmp_path):
    path = tmp_path / "profile.json"
    timer = CountingTimer(0.002, [0.01, 0.011, 0.012, 0.013, 0.014])
    profile = CostProfile(path)
    assert profile.costs(100, timer).verify == timer.costs.verify
    profile.costs(400, timer)  # same bucket
    assert timer.calls == 1
    profile.costs(600, timer)  # next bucket
    assert timer.calls == 2
    assert depth_bucket(100) == depth_bucket(512) == 512 != depth_bucket(513)
    # A new process reads the measurements back.
    assert CostProfile(path).costs(300, timer).draft == 0.002
    assert timer.calls == 2
    # Stale entries, and entries for another number of drafts, are measured again.
    CostProfile(path, max_age=-1.0).costs(300, timer)  # none is fresh, however quick
    assert timer.calls == 3
    CostProfile(path).costs(300, CountingTimer(0.002, [0.01] * 6))
    assert len(json.loads(path.read_text())["512"]["verify"]) == 6


def test_a_depth_near_its_buckets_end_takes_the_next_buckets_costs(tmp_path):
    """A generation that starts just below a bucket's end (a prompt of 2048
    tokens: one round at depth 2048, the rest past it) leaves the bucket at
    once; measuring it across rounds stalled one round of each such
    generation. Near the end, an unmeasured bucket takes the next one's
    costs where they are measured, and measures nothing."""
    timer = CountingTimer(0.002, [0.01, 0.011, 0.012, 0.013, 0.014])
    profile = CostProfile(tmp_path / "profile.json")
    near = 2048 - costs_module.NEAR_BUCKET_END + 1
    profile.costs(near, timer, most=2)  # nothing measured anywhere: measures here
    assert timer.calls == 1 and "2048" in profile._partial
    for _ in range(3 * costs_module.REPEATS):
        profile.costs(2049, timer, most=2)
    calls = timer.calls
    assert profile.known(near, timer) == profile.costs(near, timer, most=2) == timer.costs
    assert profile.known(2048, timer) == timer.costs
    assert timer.calls == calls
    # Further from the end, the bucket's own costs are measured.
    profile.costs(near - 1, timer, most=2)
    assert timer.calls == calls + 1
    assert profile.known(near - 1, timer) == RoundCosts(0.002, [0.01, 0.011, 0.012, 0.013])
    # Once measured, a bucket's own costs stand for it, to its end.
    for _ in range(3 * costs_module.REPEATS):
        profile.costs(near - 1, timer, most=2)
    own = RoundCosts(0.004, [0.02] * 5)
    profile.entries["2048"] = dict(profile.entries["2048"], draft=own.draft, verify=own.verify)
    assert profile.known(2048, timer) == profile.costs(2048, timer) == own
    # A batch generator's entries are its buckets' own (it reads them by bucket).
    batched = CountingTimer(0.002, [0.01, 0.011, 0.012, 0.013, 0.014])
    for _ in range(3 * costs_module.REPEATS):
        profile.costs(2049, batched, batch=4, most=2)
    calls = batched.calls
    profile.costs(near, batched, batch=4, most=2)
    assert batched.calls == calls + 1


def test_a_profile_measured_a_few_verifies_at_a_time_is_the_whole_measurement(tmp_path):
    """A server measures a round's costs across rounds (``most`` verifies a
    call) rather than stopping every request for all of them: each call
    times only the next lengths once, in passes over every length (the
    draft once a pass) so that the repeats of one length fall in different
    rounds, returns what is known so far, and the profile keeps it on disk
    as a measurement under way until all passes are done."""
    path = tmp_path / "profile.json"
    timer = CountingTimer(0.002, [0.01, 0.011, 0.012, 0.013, 0.014])
    profile = CostProfile(path)
    calls = 3 * costs_module.REPEATS
    seen = [profile.costs(100, timer, batch=4, most=2) for _ in range(calls - 1)]
    assert json.loads(path.read_text())["4x512"]["passes"] == costs_module.REPEATS - 1
    seen.append(profile.costs(100, timer, batch=4, most=2))
    assert [len(c.verify) for c in seen] == [2, 4] + [5] * (calls - 2)
    assert timer.verified == [1, 2, 3, 4, 5] * costs_module.REPEATS
    assert timer.drafts_timed == costs_module.REPEATS and set(timer.repeats) == {1}
    assert seen[-1] == timer.costs
    assert CostProfile(path).costs(300, timer, batch=4, most=2) == timer.costs
    assert timer.calls == calls  # read back, not measured again
    # Partial measurements are not taken for complete ones, on disk either.
    profile.costs(100, timer, batch=8, most=2)
    assert 8 not in profile.measured_batches(100, timer.verify_rows)
    assert 8 not in CostProfile(path).measured_batches(100, timer.verify_rows)
    assert json.loads(path.read_text())["8x512"]["passes"] == 0
    assert profile.partial_batches(100) == {8: RoundCosts(0.002, [0.01, 0.011])}
    assert CostProfile(path).partial_batches(100) == profile.partial_batches(100)
    assert profile.partial_batches(600) == {}
    # Once an entry goes stale it is measured again from the start, draft included.
    profile.max_age = -1.0
    timer.verified, timer.drafts_timed = [], 0
    again = profile.costs(100, timer, batch=4, most=2)
    assert timer.verified == [1, 2] and timer.drafts_timed == 1 and len(again.verify) == 2


def test_a_measurement_a_process_leaves_unfinished_the_next_goes_on_from(tmp_path):
    """A short generation (``mlx_lm.generate``, a few rounds) can end before
    its bucket's measurement, spread over its rounds, is done: the next
    process goes on where it stopped, instead of measuring the bucket from
    its first length again in every run. No reader takes it for a complete
    measurement, and one malformed on disk is measured afresh."""
    path = tmp_path / "profile.json"
    timer = CountingTimer(0.002, [0.01, 0.011, 0.012, 0.013, 0.014])
    first = CostProfile(path)
    first.costs(100, timer, most=2)
    first.costs(100, timer, most=2)
    assert CostProfile(path).measured(100, timer) is None
    second = CostProfile(path)
    assert second.known(100, timer).verify == [0.01, 0.011, 0.012, 0.013]
    while second.measured(100, timer) is None:
        second.costs(100, timer, most=2)
    assert timer.verified == [1, 2, 3, 4, 5] * costs_module.REPEATS
    assert CostProfile(path).measured(100, timer) == timer.costs

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"512": {"passes": 1, "next_length": 3, "verify": "x"}, "4x512": 5}))
    timer.verified = []
    profile = CostProfile(broken)
    assert profile.partial_batches(100) == {}
    profile.costs(100, timer, most=2)
    assert timer.verified == [1, 2]


def test_a_stale_profile_is_measured_again_to_the_end(tmp_path):
    """A bucket measured more than ``MAX_AGE`` ago is measured again across
    rounds, and the new measurement replaces it: the stale one on disk never
    wins over the one under way (each round would time the first lengths
    again, for good)."""
    path = tmp_path / "profile.json"
    stale = dict(
        draft=0.001, drafts=1, verify=[0.02] * 5, depth=512,
        measured_at=time.time() - costs_module.MAX_AGE - 60,
    )
    path.write_text(json.dumps({"512": stale}))
    timer = CountingTimer(0.002, [0.01, 0.011, 0.012, 0.013, 0.014])
    profile = CostProfile(path)
    for _ in range(3 * costs_module.REPEATS):
        profile.costs(100, timer, most=2)
    assert timer.verified == [1, 2, 3, 4, 5] * costs_module.REPEATS
    assert CostProfile(path).measured(100, timer) == timer.costs


def test_a_measurement_under_way_expires_and_a_failed_timing_leaves_none(tmp_path):
    """Past its first pass a measurement under way stands in as measured,
    until it is as old as a whole measurement may be (a server's batch size
    that left would otherwise stand in for days); a timing that fails
    leaves no measurement under way behind."""
    timer = CountingTimer(0.002, [0.01, 0.011, 0.012, 0.013, 0.014])
    profile = CostProfile(tmp_path / "profile.json")
    for _ in range(3):
        profile.costs(100, timer, batch=4, most=2)
    assert profile.measured_batches(100, 5) == {4: timer.costs}
    profile.max_age = -1.0
    assert profile.measured_batches(100, 5) == profile.partial_batches(100) == {}
    timer.verified = []
    profile.costs(100, timer, batch=4, most=2)
    assert timer.verified == [1, 2]  # from the start

    class Failing(CountingTimer):
        def __call__(self, tokens=None, draft=True, repeats=costs_module.REPEATS):
            raise RuntimeError("out of memory")

    fresh = CostProfile(None)
    with pytest.raises(RuntimeError):
        fresh.costs(100, Failing(0.002, [0.01] * 5), batch=2, most=2)
    assert fresh.partial_batches(100) == {}


def test_a_profile_measured_across_rounds_keeps_the_fastest_pass_of_each_part(tmp_path):
    """Measured a few parts a round, the repeats of one length are timed in
    different rounds: a burst that slows one round's parts (an H200's 12B
    verifies of 4 and 5 tokens, timed together, came out 20% over the rest)
    is outvoted by the other passes, part by part."""
    fast = [0.01, 0.011, 0.012, 0.013, 0.014]

    class BurstyTimer(CountingTimer):
        def __call__(self, tokens=None, draft=True, repeats=costs_module.REPEATS):
            # Each call times the next two lengths (three calls a pass); a
            # burst slows one or two calls of each pass: the draft and
            # lengths 1-2 in the first two passes (so not even their median
            # is fast), 3-4 in the second, 5 in the third.
            burst = self.calls in (0, 3, 4, 8)
            self.costs = RoundCosts(
                0.005 if burst else 0.002, [c * 2 if burst else c for c in fast]
            )
            return super().__call__(tokens, draft, repeats)

    timer = BurstyTimer(0.002, fast)
    profile = CostProfile(tmp_path / "profile.json")
    for _ in range(3 * costs_module.REPEATS):
        costs = profile.costs(100, timer, most=2)
    assert costs == RoundCosts(0.002, fast)


def test_a_proposal_is_timed_at_its_drafts_and_at_one(monkeypatch):
    """A drafter that drafts a step a draft (the Gemma-4 assistant) costs
    less for fewer drafts: the timer times a proposal of its drafts and of
    one, and a proposal of k drafts costs between the two, linearly (on an
    injected clock). A block drafter's (DSpark, DFlash) costs the same for
    any number."""
    clock = Clock()
    monkeypatch.setattr(costs_module, "time", clock)

    def work(seconds):
        clock.now += seconds
        return mx.zeros(1)

    def timer(draft):
        return costs_module.RoundTimer(
            model=None, drafter=None, drafts=6, verify=lambda n: work(0.010), draft=draft
        )

    steps = timer(lambda n: work(0.001 * n))()
    assert (steps.draft, steps.draft_one, steps.drafts) == pytest.approx((0.006, 0.001, 6))
    assert [steps.drafting(k) for k in range(8)] == pytest.approx(
        [0.0, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007]
    )
    block = timer(lambda n: work(0.004))()
    assert [block.drafting(k) for k in range(1, 7)] == pytest.approx([0.004] * 6)


def test_two_processes_writing_one_profile_keep_each_others_measurements(tmp_path):
    """Processes that share a profile (a server and ``mlx_dspark costs``,
    two workers) each write the buckets the other measured meanwhile, and
    the newer measurement of a bucket; each through a file of its own, so
    none is left half written or behind."""
    path = tmp_path / "profile.json"
    first, second = CostProfile(path), CostProfile(path)
    first.costs(100, CountingTimer(0.002, [0.01, 0.011]))
    second.costs(1000, CountingTimer(0.002, [0.01, 0.011]))
    assert set(json.loads(path.read_text())) == {"512", "1024"}
    newer = CostProfile(path, max_age=-1.0)  # re-measures what it reads
    newer.costs(100, CountingTimer(0.003, [0.02, 0.021]))
    first.costs(2000, CountingTimer(0.002, [0.01, 0.011]))
    entries = json.loads(path.read_text())
    assert set(entries) == {"512", "1024", "2048"} and entries["512"]["draft"] == 0.003
    # Nothing else is left behind but the profile's lock.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json", "profile.json.lock"]


def test_two_processes_writing_at_once_keep_each_others_measurements(tmp_path):
    """One writer has read the profile to merge it and is about to move its
    own file into place when another writes: the lock holds the other back
    until the first is done, so the first does not drop what the other
    wrote, nor the other what the first did. (Without the lock the other
    writes meanwhile, and the first's file, merged before it, replaces it.)"""
    path = tmp_path / "profile.json"
    first, second = CostProfile(path), CostProfile(path)
    merged, other_wrote = threading.Event(), threading.Event()
    read = first._read

    def read_then_wait_for_the_other():
        entries = read()
        merged.set()
        other_wrote.wait(timeout=1.0)  # never set while the lock holds it back
        return entries

    first._read = read_then_wait_for_the_other

    def other_writer():
        merged.wait(timeout=10.0)
        second.costs(1000, CountingTimer(0.002, [0.01, 0.011]))
        other_wrote.set()

    other = threading.Thread(target=other_writer)
    other.start()
    first.costs(100, CountingTimer(0.002, [0.01, 0.011]))
    other.join()
    assert set(json.loads(path.read_text())) == {"512", "1024"}


def test_a_profile_whose_lock_is_held_too_long_is_written_without_it(tmp_path, monkeypatch):
    """A writer that cannot have the lock within ``LOCK_WAIT`` seconds (a
    process stopped while it held it) writes anyway: a profile is a cache,
    and a round must not stall on it. (The 30 seconds only bound a writer
    that would wait for good.)"""
    monkeypatch.setattr(costs_module, "LOCK_WAIT", 0.05)
    path = tmp_path / "profile.json"
    held = os.open(tmp_path / "profile.json.lock", os.O_RDONLY | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        writer = threading.Thread(
            target=CostProfile(path).costs,
            args=(100, CountingTimer(0.002, [0.01, 0.011])),
            daemon=True,
        )
        writer.start()
        writer.join(timeout=30.0)
        assert not writer.is_alive()
    finally:
        os.close(held)
    assert set(json.loads(path.read_text())) == {"512"}


def test_a_profile_in_use_measures_a_bucket_again_once_it_goes_stale(tmp_path, monkeypatch):
    """A profile a process holds checks each look-up's age, not only the
    file's when it reads it: a server up for more than ``MAX_AGE`` measures
    its buckets again."""
    profile = CostProfile(tmp_path / "profile.json")
    timer = CountingTimer(0.002, [0.01, 0.011])
    profile.costs(100, timer)
    profile.costs(100, timer)
    assert timer.calls == 1
    later = time.time() + costs_module.MAX_AGE + 60
    monkeypatch.setattr(costs_module.time, "time", lambda: later)
    profile.costs(100, timer)
    assert timer.calls == 2


def test_a_profile_is_kept_per_drafter_precision_and_not_per_object(tiny_pair):
    """A drafter's costs depend on its network's precision, not only on its
    checkpoint: a drafter loaded in float16 has a profile of its own. A
    drafter without a fingerprint or a ``repr`` of its own (a plugin's) is
    known by its class, not by its object's address, which would give every
    process a new profile file."""
    model, drafter = tiny_pair

    def key(drafter):
        return costs_module.RoundTimer(model, drafter, 4, None, None).key

    half = mlx_dspark.load_drafter(DSPARK, calibration=False, dtype="float16")
    assert half.fingerprint == drafter.fingerprint and key(half) != key(drafter)

    class Bare:
        def __init__(self, network):
            self.model = network

    assert key(Bare(drafter.model)) == key(Bare(drafter.model)) != key(Bare(half.model))


def test_a_cost_is_the_fastest_of_its_repeats(monkeypatch):
    """Whatever else the host does while a verify length is timed (in a
    server, the threads streaming the last round's tokens) only adds time:
    each cost is the fastest of its timed repeats, on an injected clock
    where the untimed runs and two of the three timed ones are slowed down."""

    clock = Clock()
    monkeypatch.setattr(costs_module, "time", clock)
    # Three passes over the draft and two verifies, each run untimed, then
    # timed: slowed, quick, slowed.
    slowdowns = iter([x for timed in (3.0, 1.0, 2.5) for _ in range(3) for x in (50.0, timed)])

    def timed(seconds):
        def run():
            clock.now += seconds * next(slowdowns)
            return mx.zeros(1)

        return run

    timer = costs_module.RoundTimer(
        model=None, drafter=None, drafts=1,
        verify=lambda n: timed(0.010 * n)(), draft=lambda n: timed(0.002)(),
    )
    measured = timer()
    assert measured.draft == pytest.approx(0.002)
    assert measured.verify == pytest.approx([0.010, 0.020])


def test_profiles_measured_another_way_are_measured_again(tiny_pair, monkeypatch):
    """How a cost is read from its repeats is part of a profile's key: a
    profile measured under another rule (the median, before) is not
    found again, so it is measured again."""

    model, drafter = tiny_pair

    def key():
        return costs_module.RoundTimer(model, drafter, 4, None, None).key

    now = key()
    monkeypatch.setattr(costs_module, "TIMING", "median of the repeats")
    assert key() != now


def test_profiles_measured_under_other_launch_settings_are_measured_again(
    tiny_pair, monkeypatch
):
    """MLX's settings of how kernels are launched (CUDA graphs on or off)
    change what a round costs: a profile measured under one is not read
    under another, and unrelated variables leave the key alone."""

    model, drafter = tiny_pair

    def key():
        return costs_module.RoundTimer(model, drafter, 4, None, None).key

    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    default = key()
    monkeypatch.setenv("SOMETHING_ELSE", "1")
    assert key() == default
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    off = key()
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "1")
    assert len({default, off, key()}) == 3


def test_speculation_on_mlx_cuda_turns_cuda_graphs_off_for_unquantized_targets(
    monkeypatch, capsys
):
    """``mlx_lm.generate`` or ``mlx_lm.server`` with a hidden-state drafter
    (their preflight, before mlx-lm loads anything onto the device) sets
    ``MLX_USE_CUDA_GRAPHS=0`` on MLX-CUDA for an unquantized target, and says
    so; never over the user's own setting, for a quantized target or off
    CUDA."""
    import mlx.nn as nn

    from mlx_dspark.confidence.costs import launch_settings_for_speculation
    from mlx_dspark.integration import cli

    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "")  # restored after the test
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "preloaded", {})
    drafter = mlx_dspark.load_drafter(DSPARK, lazy=True)
    cli.preflight(str(TARGET), str(DSPARK), drafter)
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "0"
    assert "MLX_USE_CUDA_GRAPHS=0" in capsys.readouterr().err

    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "1")
    cli.preflight(str(TARGET), str(DSPARK), drafter)
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "1" and not capsys.readouterr().err

    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
    model, _ = load(str(TARGET), lazy=True)
    quantized, _ = load(str(TARGET), lazy=True)
    nn.quantize(quantized, 32, 4, class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0)
    assert launch_settings_for_speculation(quantized) == {}
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert launch_settings_for_speculation(model) == {}
    assert "MLX_USE_CUDA_GRAPHS" not in os.environ


def timed_parts(seconds, extra):
    """Parts that take ``seconds[i]`` on a fake clock, plus ``extra(calls)``
    where ``calls`` is every part's name run so far."""
    now, calls = [0.0], []

    def part(i):
        def run():
            calls.append(i)
            now[0] += seconds[i] + extra(calls)
            return mx.array(0)

        return run

    return [part(i) for i in range(len(seconds))], lambda: now[0]


def test_a_burst_of_other_work_slows_one_pass_not_every_repeat_of_a_part():
    """Costs are the fastest of passes over every part measured: a burst of
    other work on the machine over several runs in a row (on an H200, two
    verify lengths in a row measured 1.6x the rest) inflates the part it
    falls on in one pass only, not all of that part's repeats."""

    parts, clock = timed_parts([1.0, 2.0, 3.0], lambda calls: 5.0 if 3 <= len(calls) <= 12 else 0.0)
    assert costs_module.fastest_seconds(*parts, clock=clock) == [1.0, 2.0, 3.0]


def test_a_part_is_timed_where_it_repeats_its_own_shape():
    """On MLX-CUDA a change of shape costs its first round 40-70 ms: each
    part is timed right after an untimed run of itself, so its cost is that
    of a round repeating its shape, as a server's rounds mostly do."""

    def switch(calls):
        return 10.0 if len(calls) > 1 and calls[-1] != calls[-2] else 0.0

    parts, clock = timed_parts([1.0, 2.0], switch)
    assert costs_module.fastest_seconds(*parts, clock=clock) == [1.0, 2.0]


@pytest.mark.parametrize(
    "entry",
    [
        5,
        {"draft": 0.002, "verify": "fast", "measured_at": 0},
        {"draft": 0.0, "verify": [0.01] * 5, "measured_at": 0},
        {"draft": 0.002, "verify": [0.01] * 5, "measured_at": "yesterday"},
        {"draft": 0.002, "verify": [0.01] * 5, "measured_at": 1e12},  # future
    ],
)
def test_malformed_cost_profiles_are_measured_again(tmp_path, entry):
    path = tmp_path / "profile.json"
    if isinstance(entry, dict) and entry["measured_at"] == 0:
        entry["measured_at"] = __import__("time").time()
    path.write_text(json.dumps({"512": entry}))
    timer = CountingTimer(0.002, [0.01, 0.011, 0.012, 0.013, 0.014])
    assert CostProfile(path).costs(100, timer).verify == timer.costs.verify
    assert timer.calls == 1


@pytest.mark.parametrize(
    "verify, expected",
    [
        ([0.010] * 5, 4),  # verify costs nothing extra: verify every draft
        ([0.010, 0.030, 0.050, 0.070, 0.090], 0),  # each token is dear
        ([0.010, 0.011, 0.012, 0.040, 0.041], 2),  # a cliff after three tokens
    ],
)
def test_cost_scheduler_follows_the_measured_costs(tmp_path, verify, expected):
    scheduler = CostScheduler([1.0] * 4, cache_profiles=False)
    logits = [3.0, 2.0, 1.5, 1.0]  # survival 0.95, 0.84, 0.68, 0.50
    assert scheduler.choose(logits, 64, CountingTimer(0.002, verify)) == expected


# -- the engine -------------------------------------------------------------------


class RandomScheduler:
    """Verifies a random prefix each round, and with chance ``measure``
    first times the round's costs on the live caches (which must change
    nothing). The prefixes do not depend on ``measure``."""

    name = "random"
    needs_confidence = True

    def __init__(self, seed, measure=0.0):
        self.random = random.Random(seed)
        self.timing = random.Random(seed + 1)
        self.measure = measure
        self.chosen = []
        self.timed = 0

    def choose(self, logits, depth, timer):
        if self.timing.random() < self.measure:
            timer()
            self.timed += 1
        self.chosen.append(self.random.randint(0, len(logits)))
        return self.chosen[-1]


@given(
    seed=st.integers(0, 10_000),
    block_size=st.integers(1, 6),
    window=st.integers(2, 6),
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=20),
    max_tokens=st.integers(1, 40),
)
def test_any_schedule_is_lossless(seed, block_size, window, prompt, max_tokens):
    model = tiny_gemma4(seed=seed, layers=3, window=window)
    drafter = tiny_dspark(
        gemma4_text_args(layers=3, window=window),
        seed=seed + 1,
        block_size=block_size,
        taps=(0, 1),
    )
    scheduler = RandomScheduler(seed, measure=0.3)
    ours, stats = speculative(model, drafter, prompt, max_tokens, scheduler=scheduler)
    assert ours == plain_greedy(model, prompt, max_tokens)
    assert stats.scheduler == "random"
    assert [r.proposed for r in stats.history if r.drafts] == scheduler.chosen


@pytest.fixture(scope="module")
def tiny_pair():
    model, _ = load(str(TARGET))
    return model, mlx_dspark.load_drafter(DSPARK, calibration=False)


def test_cost_scheduler_in_the_engine_is_lossless_and_predicts(
    tiny_pair, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    model, drafter = tiny_pair
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    ours, stats = speculative(model, drafter, prompt, 60, scheduler="cost")
    assert ours == plain_greedy(model, prompt, 60)
    assert stats.scheduler == "cost"
    # Parked rounds (plain decode steps) draft nothing and predict nothing.
    drafted = [r for r in stats.history if r.drafts]
    assert drafted and all(r.predicted is not None for r in drafted)
    assert stats.predicted == pytest.approx(sum(r.predicted for r in drafted))
    assert "cost scheduler" in stats.summary()
    # The measured costs went to the cache, one file per target and drafter,
    # with verifies of up to 16 rows (for the padding).
    [profile] = (tmp_path / "verify-cost").glob("*.json")
    assert len(json.loads(profile.read_text())["512"]["verify"]) == 16


def test_a_scheduler_named_per_call_keeps_what_it_learnt(tiny_pair, tmp_path, monkeypatch):
    """``scheduler="cost"`` passed with each generation of a drafter loaded
    with another scheduler is one scheduler, as the drafter's own would be:
    the next generation starts from the acceptance the last one learnt."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    model, _ = tiny_pair
    drafter = mlx_dspark.load_drafter(DSPARK, calibration=False, scheduler="fixed")
    speculative(model, drafter, [65, 211, 266, 241], 30, scheduler="cost")
    scheduler = scheduler_for("cost", drafter)
    assert scheduler.recent_acceptance
    assert scheduler_for("cost", drafter) is scheduler


def test_a_long_lived_scheduler_keeps_its_costs_where_the_cache_is_now(
    tiny_pair, tmp_path, monkeypatch
):
    """A cost scheduler outlives a generation (as the drafter's does): after
    ``MLX_DSPARK_CACHE`` changes, it keeps its measured costs in the new
    folder, not in the one of its first generation."""
    model, drafter = tiny_pair
    scheduler = CostScheduler(None)
    for folder in ("first", "then"):
        monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / folder))
        # Long enough for the measurement's passes over every verify length.
        speculative(model, drafter, [65, 211, 266, 241], 100, scheduler=scheduler)
        assert list((tmp_path / folder / "verify-cost").glob("*.json")), folder


class WrongScheduler:
    name = "wrong"
    needs_confidence = True

    def __init__(self, choice):
        self.choice = choice

    def choose(self, logits, depth, timer):
        return self.choice


@pytest.mark.parametrize("choice", [-1, 5, 2.0, None])
def test_a_scheduler_choice_out_of_range_is_refused(tiny_pair, choice):
    model, drafter = tiny_pair
    with pytest.raises(ValueError, match="a scheduler must return an int in"):
        speculative(model, drafter, [65, 211], 20, scheduler=WrongScheduler(choice))


class OwnCosts:
    """A scheduler of one's own with a ``costs`` method, which the docs
    once said would be paced: it is not (only ``CostScheduler`` is)."""

    name = "own"
    needs_confidence = False

    def choose(self, logits, depth, timer):
        raise AssertionError("not asked: it needs no confidences")

    def costs(self, depth, timer):
        return RoundCosts(0.001, [0.010] + [1.0] * 7)


def test_a_scheduler_of_ones_own_verifies_every_draft(tiny_pair):
    """Without confidences it is asked nothing, and every round verifies
    every draft its budget allows (drafting would not pay on its costs, and
    a pacing would park), with the target's output."""
    model, drafter = tiny_pair
    prompt = [65, 211, 266, 241]
    ours, stats = speculative(model, drafter, prompt, 20, scheduler=OwnCosts())
    assert ours == plain_greedy(model, prompt, 20)
    emitted = 1
    for r in stats.history:
        assert r.proposed == min(drafter.block_size, 20 - emitted - 1)
        emitted += r.acceptance_length


class TableCostScheduler(CostScheduler):
    """The cost scheduler on a fixed table of round costs instead of this
    machine's timings, so that its choices depend on the confidences alone
    (and, given a ``clock``, on the rounds' times on it)."""

    def __init__(self, temperatures, draft, verify, clock=None):
        super().__init__(temperatures, cache_profiles=False, clock=clock)
        self.table = RoundCosts(draft, verify)

    def profile(self, timer):
        return SimpleNamespace(
            costs=lambda depth, timer, most=None: self.table,
            known=lambda depth, timer: self.table,
            measured=lambda depth, timer: self.table,
        )


SCHEDULED = {
    "threshold": lambda: mlx_dspark.load_drafter(
        DSPARK, confidence_threshold=0.4, calibration=False
    ),
    "cost": lambda: mlx_dspark.load_drafter(
        DSPARK, scheduler="cost", calibration=SHIPPED / "dspark_tiny_gemma4_block4.json"
    ),
}


# Round costs under which the pacing speculates (from its prior acceptance)
# and the cost scheduler's choice varies with the tiny
# drafter's confidences.
COST_TABLE = (0.002, [0.010, 0.0105, 0.011, 0.0115, 0.012])


@pytest.mark.parametrize("name", [*SCHEDULED, "random"])
def test_scheduled_sampling_keeps_the_targets_distribution(
    name, tiny_pair, tmp_path, monkeypatch
):
    """At temperature 1 with every schedule, the first three tokens (the
    prefill's, then two through a round of four drafts) have exactly the
    target's joint distribution."""
    from test_sampling import PROMPT as SAMPLING_PROMPT
    from test_sampling import exact_distribution, sample_runs

    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    model, _ = tiny_pair
    drafter = SCHEDULED[name]() if name in SCHEDULED else tiny_pair[1]
    scheduler = None
    if name == "random":
        scheduler = RandomScheduler(0)
    elif name == "cost":
        scheduler = TableCostScheduler(drafter.calibration.temperatures, *COST_TABLE)
    sampler = mlx_dspark.make_sampler(temp=1.0)
    stats = SpeculativeStats(drafter.name, drafter.block_size)

    counts = sample_runs(
        lambda: speculative(
            model, drafter, SAMPLING_PROMPT, 6, stats, sampler=sampler, scheduler=scheduler
        )[0],
        600,
        3,
    )
    verified = [r.proposed for r in stats.history if r.drafts]
    assert stats.acceptance_rule == "rejection" and len(set(verified)) > 1
    expected = exact_distribution(model, {"temp": 1.0}, {}, 3)
    assert goodness_of_fit(counts, expected) > ALPHA


def test_timing_on_the_live_caches_changes_no_sampled_token(tiny_pair):
    """With the same random seed and the same prefixes verified, a
    generation sampled at temperature 1 whose every round first times its
    costs on the live caches emits exactly the tokens of one that never
    times: the timing draws nothing from the random state, and leaves the
    caches as nothing the sampled tokens depend on would notice (the
    greedy ``test_any_schedule_is_lossless`` checks them exactly)."""
    from test_sampling import PROMPT as SAMPLING_PROMPT

    model, drafter = tiny_pair
    sampler = mlx_dspark.make_sampler(temp=1.0)
    runs = []
    for measure in (0.0, 1.0):
        mx.random.seed(11)
        scheduler = RandomScheduler(3, measure)
        tokens, stats = speculative(
            model, drafter, SAMPLING_PROMPT, 24, sampler=sampler, scheduler=scheduler
        )
        verified = [r.proposed for r in stats.history if r.drafts]
        assert verified == scheduler.chosen and len(set(verified)) > 1
        assert scheduler.timed == measure * len(scheduler.chosen)
        runs.append((tokens, verified))
    assert runs[0] == runs[1]


def test_a_drafts_confidence_never_sees_that_draft(tiny_pair):
    """c_k is computed from the drafts before k only: changing draft k
    changes no confidence up to k (what makes the schedulers causal)."""
    _, drafter = tiny_pair
    model, _ = tiny_pair
    from mlx_dspark.speculative.engine import adapt_target

    target = adapt_target(model, drafter)
    target_cache, draft_cache = target.make_cache(5), drafter.make_cache()
    out = target(mx.array([[65, 211, 266, 241, 234]]), target_cache, drafter.taps)
    drafter.commit(draft_cache, out.hidden)
    anchor = mx.array(10, mx.uint32)

    def forcing(position, token):
        drawn = []

        def draw(logits):
            choice = mx.argmax(logits, axis=-1)
            if len(drawn) == position:
                choice = mx.array([token])
            drawn.append(choice)
            return choice, None

        return draw

    base = drafter.propose(draft_cache, anchor, 4, forcing(-1, 0))
    for position in range(4):
        other_token = (base.tokens[position].item() + 7) % 512
        changed = drafter.propose(
            draft_cache, anchor, 4, forcing(position, other_token)
        )
        assert changed.tokens[position].item() == other_token
        same = slice(0, position + 1)
        assert mx.array_equal(changed.confidence[same], base.confidence[same])
        if position < 3:
            assert not mx.array_equal(changed.confidence, base.confidence)


def test_cost_scheduler_warns_when_uncalibrated_or_calibrated_for_another_temperature(
    tiny_pair, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    with pytest.warns(UserWarning, match="uncalibrated confidences"):
        mlx_dspark.load_drafter(DSPARK, scheduler="cost", calibration=False)
    model, _ = tiny_pair
    drafter = SCHEDULED["cost"]()  # calibrated at temperature 0
    with pytest.warns(UserWarning, match="fitted at temperature 0"):
        speculative(model, drafter, [65, 211], 8, sampler=mlx_dspark.make_sampler(0.8))


def test_scheduler_options_are_checked():
    with pytest.raises(ValueError, match="no confidence head.*threshold scheduler"):
        mlx_dspark.load_drafter(DFLASH, scheduler="threshold", confidence_threshold=0.5)
    assert not mlx_dspark.load_drafter(DFLASH, scheduler="cost").scheduler.needs_confidence
    with pytest.raises(ValueError, match="needs confidence_threshold"):
        mlx_dspark.load_drafter(DSPARK, scheduler="threshold")
    with pytest.raises(ValueError, match="scheduler must be one of"):
        mlx_dspark.load_drafter(DSPARK, scheduler="fastest")
    with pytest.raises(ValueError, match="applies to the threshold scheduler, not"):
        mlx_dspark.load_drafter(DSPARK, scheduler="cost", confidence_threshold=0.5)
    drafter = mlx_dspark.load_drafter(DSPARK, confidence_threshold=0.5)
    assert drafter.scheduler.name == "threshold"
    assert mlx_dspark.load_drafter(DSPARK, scheduler="cost").scheduler.name == "cost"


# -- the commands -------------------------------------------------------------------

PROMPT = "w65 w211 w266 w241 w234"


def run(*args, **environment):
    env = {k: v for k, v in os.environ.items() if k != "MLX_DSPARK_DISABLE"}
    return subprocess.run(
        [str(BIN / args[0]), *map(str, args[1:])],
        capture_output=True,
        text=True,
        env={**env, **environment},
        timeout=300,
    )


def test_calibrate_command_writes_what_loading_picks_up(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(record)
            for record in (
                {"prompt": "w490 w82 w207 w338 w29"},
                {"text": "w470 w264 w114 w24 w49 w227"},
                {"messages": [{"role": "user", "content": "w40 w128 w51 w287"}]},
                {"prompt": "w13 w327 w255 w186 w167"},
            )
        )
    )
    result = run(
        "mlx_dspark",
        "calibrate",
        "--model",
        TARGET,
        "--draft-model",
        DSPARK,
        "--prompts",
        prompts,
        "--max-tokens",
        24,
        MLX_DSPARK_CACHE=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert "4/4" not in result.stderr  # no progress bar: stderr is not a terminal
    assert "ECE before/after" in result.stdout and "held out" in result.stdout
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    calibration = mlx_dspark.load_drafter(DSPARK).calibration
    assert len(calibration.temperatures) == 4 and calibration.rounds > 0
    assert calibration.report["held_out"]["after"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--draft-model", DFLASH), "has no confidence head"),
        (("--holdout", 1.5), "--holdout must be in"),
        (("--max-tokens", 0), "--max-tokens must be positive"),
        (("--prompts", "/nonexistent.txt"), "Cannot read the prompts file"),
        (("--temp", -1), "--temp must be >= 0"),
        (("--top-p", 0), "--top-p must be in (0, 1]"),
        (("--out", "."), "is a directory"),
        (("--prompts", "BAD_JSONL"), 'needs a "prompt" or "text" string'),
    ],
)
def test_calibrate_command_refuses_bad_input(tmp_path, args, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    defaults = {"--model": TARGET, "--draft-model": DSPARK, "--prompts": prompts}
    defaults.update(dict(zip(args[::2], args[1::2])))
    if defaults["--prompts"] == "BAD_JSONL":
        defaults["--prompts"] = tmp_path / "bad.jsonl"
        defaults["--prompts"].write_text('{"prompt": 123}\n')
    flags = [str(x) for pair in defaults.items() for x in pair]
    result = run("mlx_dspark", "calibrate", *flags, MLX_DSPARK_CACHE=str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip().startswith("mlx_dspark calibrate: error:")
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_with_the_cost_scheduler_and_shipped_calibration(tmp_path, monkeypatch):
    """mlx_lm.generate under ``cost`` with the shipped calibration: the
    output is plain decoding's, and the drafted rounds' survival is
    predicted from the calibrated confidences. Whether drafting pays is
    the machine's to say, so the round costs are given (a verify of any
    length 1 s, a draft 1 ms: the first rounds draft, on any machine)."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    # What the commands set on MLX-CUDA for an unquantized target (part of
    # the profile's key), set for both processes.
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    model, _ = load(str(TARGET))
    drafter = mlx_dspark.load_drafter(DSPARK)
    key = costs_module.RoundTimer(
        model, drafter, drafter.block_size, None, None, rows=costs_module.verify_rows(drafter.block_size)
    ).key
    path = costs_module.profile_path(key)
    path.parent.mkdir(parents=True)
    entry = dict(
        draft=0.001, drafts=drafter.block_size, verify=[1.0] * 16, depth=512,
        measured_at=time.time(),
    )
    path.write_text(json.dumps({"512": entry}))
    common = ("--model", TARGET, "--prompt", PROMPT, "--max-tokens", 40)
    common += ("--ignore-chat-template",)
    plain = run("mlx_lm.generate", *common)
    ours = run(
        "mlx_lm.generate",
        *common,
        "--draft-model",
        DSPARK,
        "--draft-scheduler",
        "cost",
        "--draft-calibration",
        SHIPPED / "dspark_tiny_gemma4_block4.json",
        MLX_DSPARK_CACHE=str(tmp_path),
    )
    assert ours.returncode == 0, ours.stderr
    text = plain.stdout.split("==========")[1]
    assert ours.stdout.split("==========")[1] == text
    assert "cost scheduler" in ours.stdout and "predicted" in ours.stdout
    # The given costs were the ones read: nothing was measured (a
    # measurement spread over rounds may not finish within 40 tokens), and
    # on them every round drafts and verifies each draft.
    assert "without drafts" not in ours.stdout and " -" not in ours.stdout.split("position")[-1]
    assert list(path.parent.iterdir()) == [path]
    assert json.loads(path.read_text()) == {"512": entry}
