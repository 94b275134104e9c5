"""The cost scheduler's pacing of a single stream: padded verifies, parking
and adaptive drafts, on injected cost curves (never this machine's speed)."""

import copy
import gc
import itertools
import math
import random
import statistics
import threading
import weakref
from types import SimpleNamespace

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mlx_dspark
from mlx_dspark import SpeculativeStats, speculative_generate_step
from mlx_dspark.batching.policy import REPROBE_AT_MOST, REPROBE_EVERY, Acceptance
from mlx_dspark.confidence.costs import REPEATS, RoundCosts, RoundTimer, verify_rows
from mlx_dspark.confidence.schedulers import CostScheduler, FixedScheduler, scheduler_for
from mlx_dspark.speculative import engine
from mlx_dspark.speculative.pacing import THREADS_KEPT, Pacing

from chisquare import goodness_of_fit
from test_assistant import case, drafter_for
from test_confidence import TableCostScheduler
from test_lossless import plain_greedy, speculative, trained
from test_sampling import ALPHA, PROMPT, exact_distribution, sample_runs
from tiny import counted_expectations

# The 4-bit Gemma-4-12B target on an H200 (issue #14, ms): 7 rows cost
# twice as much as 8.
FOUR_BIT = [
    x / 1000
    for x in [14.3, 23.2, 29.5, 39.3, 43.3, 50.1, 56.1, 29.2]
    + [29.3, 29.5, 29.8, 30.2, 30.3, 30.3, 30.4, 30.4]
]


# A single-stream profile measured on a 2-core CPU while a test suite ran
# on it (the tiny bundled pair, context 1024, ms): 5 rows under 1 row, alone.
NOISY = [
    x / 1000
    for x in [16.85, 17.79, 17.67, 17.27, 12.13, 22.7, 23.75, 20.74]
    + [23.9, 24.82, 27.87, 29.67, 28.14, 32.91, 33.91, 35.73]
]


def test_a_generations_own_rates_value_the_drafts_it_never_verified_as_those_before_them():
    """The rates a generation's rounds are chosen by are its own (a newcomer of
    its drafter's recent rates): after rounds that verified 2 of 6 drafts,
    drafts 3 to 6 are worth what the second earned, not the prior's 0.5."""
    pacing = Pacing(TableCostScheduler(None, 0.004, FOUR_BIT), None, 6)
    for accepted in [2, 1, 2, 0, 2, 2] * 10:
        pacing.update(2, accepted)
    own = pacing.acceptance.rates()
    assert abs(own[1] - 0.5) > 0.05
    assert own[2:] == pytest.approx([own[1]] * 4)


def test_a_jagged_curve_pads_and_parks():
    costs = RoundCosts(0.004, FOUR_BIT)
    # 3 rows (29.5 ms) against 8 (29.2 ms) is no saving worth the rows.
    assert [costs.cheapest_rows(n) for n in (1, 2, 3, 4, 7, 8, 9)] == [1, 2, 3, 8, 8, 8, 9]
    assert costs.padded().verify[:8] == FOUR_BIT[:3] + [FOUR_BIT[7]] * 5
    scheduler = TableCostScheduler(None, 0.004, FOUR_BIT)
    assert not scheduler.needs_confidence
    pacing = Pacing(scheduler, None, 6)
    assert pacing.rows(7, 2048) == 8
    # The assistant's 6 drafts at chat-like acceptance (0.7 a draft) pay
    # when verified as 8 rows (29 ms); the 7 rows' 56 ms would park.
    for _ in range(40):
        pacing.update(6, [2, 1, 3, 6, 0, 1, 2, 3, 0, 4][_ % 10])
    assert pacing.drafts(6, 2048) == 6
    # Nothing accepted: plain decoding, with a probe round (8 rows and the
    # draft, 33 ms, for about one token: 18 ms lost against a plain round's
    # 14.3) every 64 rounds, where every 32 would lose 4% of the time
    # (PROBE_SHARE: 3%).
    for _ in range(200):
        pacing.update(6, 0)
    choices = [pacing.drafts(6, 2048) for _ in range(REPROBE_AT_MOST)]
    assert [i for i, k in enumerate(choices) if k] == [63, 127, 191, 255]
    assert set(choices) == {0, 6}
    # Untimed (no clock), a single stream never tries a plain round while
    # drafting pays, to learn what one really costs.
    for _ in range(40):
        pacing.update(6, 6)
    assert all(pacing.drafts(6, 2048) for _ in range(3 * REPROBE_EVERY))
    # Without padding, 6 drafts verify as 7 rows (56 ms): the same acceptance
    # drafts 2 (3 rows and the draft, 33.5 ms, for about 2.4 tokens against
    # a plain step's 14.3 ms for one), never more.
    unpadded = Pacing(TableCostScheduler(None, 0.004, FOUR_BIT), None, 6)
    unpadded.scheduler.costs = lambda depth, timer, most=None: RoundCosts(0.004, FOUR_BIT)
    for _ in range(40):
        unpadded.update(6, [2, 1, 3, 6, 0, 1, 2, 3, 0, 4][_ % 10])
    assert {unpadded.drafts(6, 2048) for _ in range(2 * REPROBE_EVERY)} == {2}


# A 4-bit 12B target's verify costs (ms) for 1-16 rows and a DSpark draft's,
# measured on the H200: 7 drafts verify padded to 8 rows, 31.4 ms with the
# draft against a plain step's 13.7 (BENCHMARKS.md, "Session 21").
DSPARK_4BIT = [13.7, 22.3, 28.7, 35.3, 42.0, 47.8, 54.5, 27.7, 27.9, 27.6, 27.8, 27.9, 28.2, 27.9, 28.3, 28.1]


def parked_share(kept: float, seed: int, rounds: int = 1000) -> float:
    """The share of a paced stream's rounds that park, on DSPARK_4BIT's
    costs, each draft kept with chance ``kept`` after a kept one."""
    draws = random.Random(seed)
    pacing = Pacing(TableCostScheduler(None, 0.0037, [ms / 1000 for ms in DSPARK_4BIT]), None, 7)
    parked = 0
    for _ in range(rounds):
        drafts = pacing.drafts(7, 2048)
        accepted = 0
        while accepted < drafts and draws.random() < kept:
            accepted += 1
        pacing.update(drafts, accepted)
        parked += drafts == 0
    return parked / rounds


def test_a_stream_that_never_drafted_probes_its_acceptance_at_once():
    """On the 4-bit curve the prior acceptance (0.5 a draft) does not pay
    for drafting, so a fresh stream that does not draft its first rounds
    regardless (``Acceptance.untried`` cleared) parks; it probes in its
    first round, not after ``REPROBE_EVERY`` parked ones, and a drafter
    whose drafts are kept drafts from then on. (Parked on the prior, an ``mlx_lm.generate`` run on
    the H200 first probed after 255 rounds.) A stream of the same drafter
    later in the process starts from what the first one learnt."""
    scheduler = TableCostScheduler(None, 0.0037, [ms / 1000 for ms in DSPARK_4BIT])
    for _ in range(2):
        pacing, choices = Pacing(scheduler, None, 7), []
        pacing.acceptance.untried = False
        for _ in range(REPROBE_EVERY):
            choices.append(pacing.drafts(7, 2048))
            pacing.update(choices[-1], choices[-1])
        assert choices == [7] * REPROBE_EVERY


def test_a_drafter_whose_drafts_never_pay_probes_once_not_every_generation():
    """Nothing accepted: the first generation drafts in its first 3 rounds
    (``YOUNG_ROUNDS``: its drafter had verified no draft), and later
    generations of the drafter start parked, probing only on the schedule
    the parked rounds of all of them set (``REPROBE_EVERY`` and up), not
    each at its start."""
    scheduler = TableCostScheduler(None, 0.0037, [ms / 1000 for ms in DSPARK_4BIT])
    generations = []
    for _ in range(6):
        pacing, choices = Pacing(scheduler, None, 7), []
        for _ in range(REPROBE_EVERY):
            choices.append(pacing.drafts(7, 2048))
            pacing.update(choices[-1], 0)
        generations.append(choices)
    assert generations[0][:3] == [7] * 3 and not any(generations[0][3:])
    assert [g[0] for g in generations[1:]] == [0] * 5
    probes = [i for i, k in enumerate(sum(generations, [])) if k][3:]
    assert probes and all(i > REPROBE_EVERY and i % REPROBE_EVERY for i in probes)


class MeasuredAsItGoes(TableCostScheduler):
    """A fresh machine's costs, which a first generation measures as it
    goes: each round's choice measures ``most`` more verify lengths."""

    def __init__(self, draft, verify, clock=None):
        super().__init__(None, draft, verify, clock)
        self.lengths = 0

    def profile(self, timer):
        def costs(depth, timer, most=None):
            self.lengths = min(self.lengths + most, len(self.table.verify))
            return measured()

        measured = lambda *_: RoundCosts(self.table.draft, self.table.verify[: self.lengths])  # noqa: E731
        return SimpleNamespace(costs=costs, known=measured, measured=lambda *_: None)


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("kept", [True, False])
def test_a_stream_measuring_its_costs_as_it_goes_probes_as_deep_as_they_reach(kept, timed):
    """With one or two verify lengths measured, one draft does not pay on
    the 4-bit curve at the prior acceptance, so the stream parks; its probe
    of one draft may not be its only one: each round that measures deeper
    probes as deep as drafting could pay. A drafter whose drafts are kept
    drafts 7 a round once the costs reach 8 rows, not after
    ``REPROBE_EVERY`` parked rounds; one whose drafts are never kept probes
    once per depth reached and parks. Timed, each round takes what its
    costs say (and a stream that never ran plain tries plain rounds after
    its 16th drafting round, to learn what they cost)."""
    clock = Clock() if timed else None
    scheduler = MeasuredAsItGoes(0.0037, [ms / 1000 for ms in DSPARK_4BIT], clock)
    pacing, choices = Pacing(scheduler, None, 7), []
    for _ in range(REPROBE_EVERY):
        choices.append(pacing.drafts(7, 2048))
        if timed:
            clock.now += scheduler.table.padded().verify[choices[-1]] + (0.0037 if choices[-1] else 0)
        pacing.update(choices[-1], choices[-1] if kept else 0)
    if kept:
        assert choices[:3] == [1, 3, 5] and choices[3:15] == [7] * 12
        assert choices[15] == (0 if timed else 7)
    else:
        assert choices == [1, 3, 5, 7] + [0] * (REPROBE_EVERY - 4)


def test_a_stream_where_drafting_pays_by_a_fifth_seldom_parks():
    """Each draft kept at 0.7 (tau 3.3): drafting every round serves about
    1.37x plain on these costs, and only a run of poor rounds makes the
    acceptance estimate say otherwise. With a memory of about 30 rounds the
    pacing parks in few rounds (with one of 10 it parked in a third, on the
    H200 in most); where drafts are kept at 0.3 it parks in almost all."""
    assert statistics.mean(parked_share(0.7, seed) for seed in range(8)) < 0.2
    assert statistics.mean(parked_share(0.3, seed) for seed in range(3)) > 0.9


class Clock:
    """A clock that moves only when told to."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def slow_forwards(monkeypatch, clock, seconds):
    """Every forward of the engine's target takes ``seconds`` on ``clock``."""
    adapt = engine.adapt_target

    class Slow:
        def __init__(self, target):
            self.target = target

        def __getattr__(self, name):
            return getattr(self.target, name)

        def __call__(self, tokens, *args):
            clock.now += seconds
            return self.target(tokens, *args)

    monkeypatch.setattr(engine, "adapt_target", lambda *a: Slow(adapt(*a)))


class MeasuringCostScheduler(TableCostScheduler):
    """Costs measured on the live caches whenever a round asks for them:
    each measurement takes a second of the clock (waiting for the rounds in
    flight, say), and the profile counts its ``timings``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.measuring = SimpleNamespace(
            timings=0, costs=self.measure, known=lambda depth, timer: self.table,
            measured=lambda depth, timer: None,
        )

    def measure(self, depth, timer, most=None):
        self.measuring.timings += 1
        self.clock.now += 1.0
        return self.table

    def profile(self, timer):
        return self.measuring


@pytest.mark.usefixtures("frequent_probes")
@pytest.mark.parametrize("measuring", [False, True], ids=["measured", "measuring"])
def test_a_single_stream_parks_when_its_drafting_rounds_run_slower_than_measured(
    monkeypatch, measuring
):
    """Every target forward takes the 10 ms measured on the scheduler's
    clock, but every drafting round takes 40 ms more (its launch, say), so
    drafting pays on the measured costs only: once the shape's first rounds are past, the pacing learns it,
    decodes plainly and probes now and then (drafts would pay if all were
    accepted); the drafter's next generation parks from its first round.
    Untimed, the same generation keeps drafting. The output is the target's
    either way. Time spent measuring costs counts for no round, and a parked
    round in flight while the next one's choice measured is not observed."""
    model, drafter = trained("gemma4", "dflash")
    clock, propose = Clock(), drafter.propose

    def slow_drafting(*args, **kwargs):
        clock.now += 0.04
        return propose(*args, **kwargs)

    monkeypatch.setattr(drafter, "propose", slow_drafting)
    slow_forwards(monkeypatch, clock, 0.010)
    prompt, flat = [65, 211, 266, 241, 234, 10, 325, 168], [0.010] + [0.012] * 15
    kind = MeasuringCostScheduler if measuring else TableCostScheduler
    timed = kind(None, 0.002, flat, clock=clock)
    ours, stats = speculative(model, drafter, prompt, 96, scheduler=timed)
    assert ours == plain_greedy(model, prompt, 96)
    drafted = [r.proposed > 0 for r in stats.history]
    assert all(drafted[:3]) and not any(drafted[3:REPROBE_EVERY])
    assert 0 < sum(drafted[3:]) <= len(drafted[3:]) // 4  # probes

    again, stats = speculative(model, drafter, prompt, 24, scheduler=timed)
    assert again == ours[:24] and not any(r.proposed for r in stats.history[:5])

    untimed = TableCostScheduler(None, 0.002, flat)
    ours, stats = speculative(model, drafter, prompt, 96, scheduler=untimed)
    assert ours == plain_greedy(model, prompt, 96)
    assert all(r.proposed for r in stats.history[:-1])


def test_a_single_stream_slower_than_measured_in_every_round_keeps_drafting(monkeypatch):
    """Every target forward takes 30 ms on the scheduler's clock, whatever
    its rows: plain rounds run as much slower than measured as drafting
    ones, so drafting still pays; the pacing learns the plain rounds'
    overhead too (trying a few plain rounds to learn it) and keeps drafting."""
    model, drafter = trained("gemma4", "dflash")
    clock = Clock()
    slow_forwards(monkeypatch, clock, 0.03)
    prompt, flat = [65, 211, 266, 241, 234, 10, 325, 168], [0.010] + [0.012] * 15
    scheduler = TableCostScheduler(None, 0.002, flat, clock=clock)
    ours, stats = speculative(model, drafter, prompt, 96, scheduler=scheduler)
    assert ours == plain_greedy(model, prompt, 96)
    [policy] = scheduler.paced_policies.values()
    assert set(policy.overheads) == {(1, True), (1, False)}
    drafted = [r.proposed > 0 for r in stats.history]
    assert not all(drafted) and sum(drafted) >= 0.75 * len(drafted)


@pytest.mark.parametrize("scheduler", ["table", "measuring", "confidences-read"])
def test_a_finished_generation_leaves_its_caches_to_be_freed(monkeypatch, scheduler):
    """The pacing's policy outlives a generation (the drafter keeps what it
    learnt) but not its caches: held, a long context's caches would stay in
    memory through the next generation's prefill, two generations' at once.
    So too where the generation ends with its costs measured in part (a
    real cost profile, injected timings), its drafts' confidences read."""
    model, drafter = trained("gemma4", "dspark" if scheduler == "confidences-read" else "dflash")
    made, split = [], engine._split_prompt_cache

    def recorded(*args):
        caches = split(*args)
        made.extend(weakref.ref(c) for part in caches for c in part)
        return caches

    monkeypatch.setattr(engine, "_split_prompt_cache", recorded)
    flat = [0.010] + [0.012] * 15
    if scheduler == "table":
        scheduler = TableCostScheduler(None, 0.002, flat, clock=Clock())
    else:
        monkeypatch.setattr(
            RoundTimer, "__call__",
            lambda timer, tokens=None, draft=True, repeats=REPEATS: RoundCosts(
                0.002 if draft else 0.0, [flat[n - 1] for n in tokens]
            ),
        )
        temperatures = [1.0] * drafter.block_size if scheduler == "confidences-read" else None
        scheduler = CostScheduler(temperatures, cache_profiles=False, clock=Clock())
    speculative(model, drafter, [65, 211, 266, 241, 234, 10, 325, 168], 6, scheduler=scheduler)
    gc.collect()
    assert made and scheduler.paced_policies
    assert not [ref for ref in made if ref() is not None]


def test_generations_advanced_in_turn_observe_their_own_rounds():
    """Two generations of one drafter on one thread share its policy (what
    it learnt), but not their rounds chosen and not yet read: a parked
    round chosen ahead stays chosen across a yield, and the other
    generation's round read meanwhile is observed against its own choice."""
    clock = Clock()
    scheduler = TableCostScheduler(None, 0.002, [0.010] + [0.012] * 15, clock=clock)
    first = Pacing(scheduler, None, 6)
    assert first.drafts(6, 100) > 0
    second = Pacing(scheduler, None, 6)
    assert second.policy is first.policy and second.drafts(0, 100) == 0
    observed, observe = [], first.policy.observe

    def recording(seconds):
        observed.append(first.policy._chosen[0][1])
        observe(seconds)

    first.policy.observe = recording
    second.update(0, 0)
    first.update(6, 3)
    assert observed[0] == 0 and observed[1] > 0


def test_a_stream_on_a_new_thread_starts_from_what_the_last_one_learnt():
    """A stream on a thread new to the drafter (a server's handler, a
    pool's worker) gets a policy of its own, starting from the overheads the
    streams of the thread that paced last learnt, not from nothing; the
    scheduler keeps the policies of the threads that paced last only,
    however many threads come and go."""
    scheduler = TableCostScheduler([1.0] * 4, 0.002, [0.010] * 16)
    first = Pacing(scheduler, None, 4)
    first.policy.overheads[1, True] = 0.003
    started, release, made = threading.Barrier(THREADS_KEPT + 5), threading.Event(), []

    def stream():
        made.append(Pacing(scheduler, None, 4).policy)
        started.wait()
        release.wait()

    threads = [threading.Thread(target=stream) for _ in range(THREADS_KEPT + 4)]
    for thread in threads:
        thread.start()
    try:
        started.wait(timeout=60)
        assert len(scheduler.paced_policies) == THREADS_KEPT
        assert all(p is not first.policy and p.overheads == {(1, True): 0.003} for p in made)
    finally:
        release.set()
        for thread in threads:
            thread.join()
    assert Pacing(scheduler, None, 4).policy is not first.policy  # this thread's was dropped


def test_a_round_whose_confidences_verify_fewer_drafts_is_timed_against_those(monkeypatch):
    """A round that drafted 4 but verifies 1 (its drafter's confidences
    said so) is weighed against the costs of verifying 1, not 4: what it
    took beyond them is the drafting rounds' overhead, and the engine says
    so for every such round, and only for those."""
    dear = [0.010, 0.030, 0.031, 0.032, 0.033] + [0.034] * 11
    clock = Clock()
    pacing = Pacing(TableCostScheduler([1.0] * 4, 0.002, dear, clock=clock), None, 4)
    for _ in range(6):
        for _ in range(10):  # an acceptance at which 4 drafts pay
            pacing.acceptance.update(4, 4)
        assert pacing.drafts(4, 512) == 4
        pacing.verifies(1, 512, 4)
        clock.now += 0.002 + dear[1] + 0.005
        pacing.update(1, 1)
    assert pacing.policy.overheads[1, True] == pytest.approx(0.005)

    model, drafter = trained("gemma4", "dspark")
    told = []
    monkeypatch.setattr(Pacing, "verifies", lambda self, drafts, depth, drawn: told.append(drafts))
    costs = [0.010, 0.011, 0.012, 0.030, 0.031] + [0.032] * 11
    scheduler = TableCostScheduler([1.0] * 4, 0.002, costs)
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    ours, stats = speculative(model, drafter, prompt, 48, scheduler=scheduler)
    assert ours == plain_greedy(model, prompt, 48)
    truncated = [r.proposed for r in stats.history if len(r.drafts) > r.proposed]
    assert truncated and told == truncated


def test_a_generation_that_fails_mid_round_leaves_the_next_ones_times_in_step(monkeypatch):
    """A round chosen and never read (its generation raised in between)
    is not the round the drafter's next generation observes first: every
    time observed belongs to the round it timed."""
    model, drafter = trained("gemma4", "dflash")
    scheduler = TableCostScheduler(None, 0.002, [0.010] + [0.012] * 15, clock=Clock())
    propose, calls = drafter.propose, []

    def failing_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return propose(*args, **kwargs)

    monkeypatch.setattr(drafter, "propose", failing_third)
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    with pytest.raises(RuntimeError):
        speculative(model, drafter, prompt, 24, scheduler=scheduler)
    [policy] = scheduler.paced_policies.values()
    assert len(policy._chosen) == 1  # the failed round's choice
    ours, _ = speculative(model, drafter, prompt, 24, scheduler=scheduler)
    assert ours == plain_greedy(model, prompt, 24) and not policy._chosen


def test_a_generation_starts_from_the_drafters_recent_acceptance():
    """The cost scheduler keeps its drafter's acceptance over generations:
    after a generation that accepted nothing, the next one parks from its
    first round, where a fresh scheduler's prior would draft."""
    flat = [0.010] + [0.012] * 15
    scheduler = TableCostScheduler(None, 0.002, flat)
    first = Pacing(scheduler, None, 6)
    assert first.acceptance.rates() == [0.5] * 6 and first.drafts(6, 2048) == 6
    for _ in range(20):
        first.update(6, 0)
    second = Pacing(scheduler, None, 6)
    assert second.acceptance.rates() == first.recent.rates()
    assert second.drafts(6, 2048) == 0
    assert Pacing(TableCostScheduler(None, 0.002, flat), None, 6).drafts(6, 2048) == 6


def doubtful(monkeypatch, drafter, logit):
    """Every draft's confidence logit is ``logit``."""
    propose = drafter.propose

    def proposing(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        proposal.confidence = mx.full(proposal.tokens.shape, logit)
        return proposal

    monkeypatch.setattr(drafter, "propose", proposing)


def test_a_stream_whose_confidences_refuse_its_drafts_stops_drafting(monkeypatch):
    """A drafter's generations so far accepted every draft, so its next
    generation starts out drafting; now its calibrated confidences say each
    draft is kept at 2% (a raw 27%, at which drafting would pay), and the
    schedule verifies none. The drafts drawn and not verified count at
    their calibrated confidences, so within about 30 rounds (the
    acceptance's memory) the pacing stops drafting, but for its probes.
    (Counting only what it verified, it would draft and verify nothing in
    every round.) The output is the target's."""
    model, drafter = trained("gemma4", "dspark")
    flat = [0.010] + [0.0105] * 15
    scheduler = TableCostScheduler([0.25] * drafter.block_size, 0.001, flat)
    earlier = Pacing(scheduler, None, drafter.block_size)
    for _ in range(40):
        earlier.update(drafter.block_size, drafter.block_size)
    doubtful(monkeypatch, drafter, logit=-1.0)
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    ours, stats = speculative(model, drafter, prompt, 96, scheduler=scheduler)
    assert ours == plain_greedy(model, prompt, 96)
    drafted = [bool(r.drafts) for r in stats.history]
    assert all(drafted[:10]) and not any(r.proposed for r in stats.history)
    assert sum(drafted[48:]) <= 48 // REPROBE_EVERY


class FirstTwoDrafts(TableCostScheduler):
    """Verifies a round's first two drafts, whatever their confidences."""

    def choose(self, logits, depth, timer):
        return min(2, len(logits))


def test_refused_drafts_count_only_after_every_verified_one_was_kept(monkeypatch):
    """Each round verifies its first two drafts and refuses the rest. A
    round that kept both (and stopped at no stop token) counts each refused
    draft at its own position's calibrated confidence, ``σ(z_j / T_j)``, in
    the generation's acceptance and in the one the drafter's later
    generations start from; a round that rejected a verified draft counts
    none."""
    model, drafter = trained("gemma4", "dspark")
    logits, temperatures = [2.0, 1.0, -0.5, -1.5], [1.0, 0.5, 2.0, 4.0]
    assert drafter.block_size == len(logits)
    scheduler = FirstTwoDrafts(temperatures, 0.001, [0.010] + [0.0105] * 15)
    propose = drafter.propose

    def confident(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        proposal.confidence = mx.array(logits[: proposal.tokens.size])
        return proposal

    monkeypatch.setattr(drafter, "propose", confident)
    counted = counted_expectations(monkeypatch)
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    ours, stats = speculative(model, drafter, prompt, 64, scheduler=scheduler)
    assert ours == plain_greedy(model, prompt, 64)
    drafting = [r for r in stats.history if r.drafts]
    refusing = [
        r for r in drafting
        if r.accepted == r.proposed < len(r.drafts) and r.next_token is not None
    ]
    assert refusing and any(r.accepted < r.proposed for r in drafting)
    kept = [1 / (1 + math.exp(-z / t)) for z, t in zip(logits, temperatures)]
    expected = [(r.proposed, kept[r.proposed : len(r.drafts)]) for r in refusing]
    recent = scheduler.recent_acceptance[drafter.block_size]
    for generation in (False, True):
        calls = [(first, rates) for a, first, rates in counted if (a is not recent) == generation]
        assert [first for first, _ in calls] == [first for first, _ in expected]
        for (_, rates), (_, want) in zip(calls, expected):
            assert rates == pytest.approx(want)


def verify_rows_seen(monkeypatch):
    """The row counts of the target's forwards, as the engine runs them."""
    seen, adapt = [], engine.adapt_target

    class Spy:
        def __init__(self, target):
            self.target = target

        def __getattr__(self, name):
            return getattr(self.target, name)

        def __call__(self, tokens, *args):
            seen.append(tokens.shape[1])
            return self.target(tokens, *args)

    monkeypatch.setattr(engine, "adapt_target", lambda *a: Spy(adapt(*a)))
    return seen


def test_a_lone_cheap_row_count_is_noise_and_pads_nothing():
    """A verify of 5 rows measured 28% under one row, and 6 rows 35% over
    it: no kernel switch makes one row count alone cheap, so no verify is
    padded to it (every parked round would otherwise verify five rows, and
    run slower than a plain step). A real switch, where the rows after it
    cost as little, still pads."""
    costs = RoundCosts(0.001, NOISY)
    assert [costs.cheapest_rows(n) for n in range(1, 17)] == list(range(1, 17))
    assert costs.padded() == costs
    switch = RoundCosts(0.001, NOISY[:4] + [0.012] * 12)
    assert [switch.cheapest_rows(n) for n in range(1, 6)] == [5, 5, 5, 5, 5]


# 5 rows (4 drafts) cost more than 8: every speculative round pads to 8.
JAGGED = [0.010, 0.020, 0.030, 0.040, 0.050, 0.060, 0.070] + [0.015] * 9


def test_the_engine_verifies_at_the_cheapest_row_count(monkeypatch):
    model, drafter = trained("gemma4", "dflash")
    seen = verify_rows_seen(monkeypatch)
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    ours, stats = speculative(
        model, drafter, prompt, 40, scheduler=TableCostScheduler(None, 0.001, JAGGED)
    )
    assert ours == plain_greedy(model, prompt, 40)
    rounds = seen[2:]  # after the prompt's two forwards
    assert len(rounds) == stats.rounds
    assert [n for n, r in zip(rounds, stats.history) if r.proposed] == [8] * sum(
        1 for r in stats.history if r.proposed
    )
    assert {n for n, r in zip(rounds, stats.history) if not r.proposed} <= {1}
    assert any(r.proposed for r in stats.history)


@pytest.mark.parametrize("confidences", [False, True], ids=["drafts-paced", "confidences-read"])
def test_a_single_stream_measures_a_few_verify_lengths_a_round(monkeypatch, confidences):
    """On a machine with no cost profile yet, a generation under the cost
    scheduler does not stop for the whole measurement (16 verify lengths):
    each round times the next two once (the draft with the first), in
    passes over all of them, drafts no further than the lengths timed so
    far reach (nor, reading the drafts' confidences, verifies further), and
    the output is still the target's."""
    model, drafter = trained("gemma4")
    calls, flat = [], [0.010] + [0.012] * 15  # drafting pays (injected costs)

    def measured(timer, tokens=None, draft=True, repeats=REPEATS):
        assert repeats == 1
        calls.append(list(tokens))
        return RoundCosts(0.002 if draft else 0.0, [flat[n - 1] for n in tokens])

    monkeypatch.setattr(RoundTimer, "__call__", measured)
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    temperatures = [1.0] * drafter.block_size if confidences else None
    scheduler = CostScheduler(temperatures, cache_profiles=False, clock=None)
    ours, stats = speculative(model, drafter, prompt, 48, scheduler=scheduler)
    assert ours == plain_greedy(model, prompt, 48)
    one_pass = [[n, n + 1] for n in range(1, verify_rows(drafter.block_size), 2)]
    # One call a round, but for the last (no draft fits the budget).
    assert len(calls) == min(stats.rounds - 1, REPEATS * len(one_pass))
    assert calls == (one_pass * REPEATS)[: len(calls)]
    reach = itertools.accumulate((timed[-1] for timed in calls), max)
    measuring = list(zip(stats.history, reach))
    assert all(r.proposed + 1 <= reached for r, reached in measuring)
    assert any(r.proposed for r, _ in measuring)


# Drafting never pays, however many drafts are accepted: the pacing parks
# from the first round and never probes.
PARKED = [0.010] + [0.050] * 15


def test_a_parked_stream_builds_each_round_before_reading_the_one_before(monkeypatch):
    """Parked, a round is chosen and built before the round before it is
    read, so that the device works on it meanwhile, as mlx-lm's plain
    decoding overlaps its steps: before each token is yielded, the prompt's
    too, the target forward of the next one is already built (but for the
    last, where none follows; and none where the prompt's token is the only
    one asked for)."""
    model, drafter = trained("gemma4", "dflash")
    forwards = verify_rows_seen(monkeypatch)
    prompt, max_tokens = [65, 211, 266, 241, 234, 10, 325, 168], 12
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    steps = speculative_generate_step(
        mx.array(prompt), model, drafter, max_tokens=max_tokens, stats=stats,
        scheduler=TableCostScheduler(None, 0.05, PARKED),
    )
    ours, built = [], []
    for token, _, _ in steps:
        ours.append(token)
        built.append(len(forwards) - 2)  # after the prompt's two forwards
    assert ours == plain_greedy(model, prompt, max_tokens)
    assert not any(r.proposed for r in stats.history)
    assert set(forwards[2:]) == {1}
    decoded = max_tokens - 1
    assert built == [min(k + 1, decoded) for k in range(max_tokens)]

    forwards.clear()
    steps = speculative_generate_step(
        mx.array(prompt), model, drafter, max_tokens=1,
        scheduler=TableCostScheduler(None, 0.05, PARKED),
    )
    assert [t for t, _, _ in steps] == ours[:1] and len(forwards) == 2


def test_the_prompts_token_waits_for_no_measurement(monkeypatch):
    """Where the costs at the prompt's depth are not all measured yet, the
    first round is chosen (and its verifies timed) only after the prompt's
    token is yielded; once they are, it is chosen before."""
    model, drafter = trained("gemma4", "dflash")
    forwards = verify_rows_seen(monkeypatch)
    chosen, drafts = [], Pacing.drafts

    def counted(self, cap, depth):
        chosen.append(depth)
        return drafts(self, cap, depth)

    monkeypatch.setattr(Pacing, "drafts", counted)
    scheduler = CostScheduler(None, cache_profiles=False, clock=None)
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    for measured, max_tokens in ((False, 160), (True, 16)):
        forwards.clear(), chosen.clear()
        steps = speculative_generate_step(
            mx.array(prompt), model, drafter, max_tokens=max_tokens, scheduler=scheduler
        )
        first = next(steps)[0]
        assert len(chosen) == measured and (measured or len(forwards) == 2)
        ours = [first] + [t for t, _, _ in steps]
        assert ours == plain_greedy(model, prompt, max_tokens)


def test_a_round_chosen_and_never_run_counts_for_no_later_generation():
    """A parked stream's first round is chosen before the prompt's token is
    read: a probe, as no round of the drafter's has drafted yet
    (``probe_first``). Where that token stops the generation, the probe
    never runs, and the drafter's next generation probes in its first round
    all the same, not after ``REPROBE_EVERY`` parked ones."""
    model, drafter = trained("gemma4", "dflash")
    prompt = [65, 211, 266, 241, 234, 10, 325, 168]
    first = plain_greedy(model, prompt, 1)[0]
    scheduler = TableCostScheduler(None, 0.002, [0.010] + [0.018] * 15)
    stopped = list(speculative_generate_step(
        mx.array(prompt), model, drafter, max_tokens=40, stop_tokens=[first], scheduler=scheduler
    ))
    assert [t for t, _, _ in stopped] == [first]
    [policy] = scheduler.paced_policies.values()
    assert (policy.parked, policy.drafting, policy.deepest) == (0, 0, 0)
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    ours = [t for t, _, _ in speculative_generate_step(
        mx.array(prompt), model, drafter, max_tokens=30, stats=stats, scheduler=scheduler
    )]
    assert ours == plain_greedy(model, prompt, 30)
    assert stats.history[0].proposed > 0


def test_an_abandoned_round_leaves_the_counts_of_another_generations_rounds():
    """Two generations advanced in turn on one thread share its policy: one
    that ends with a round chosen and never run takes back only its own
    choice's counts, and none once the other has chosen since. (The drafter
    was tried before and kept nothing: its generations start parked.)"""
    scheduler = TableCostScheduler(None, 0.0037, [ms / 1000 for ms in DSPARK_4BIT])
    tried(scheduler, 7)
    one = Pacing(scheduler, None, 7)
    one.drafts(7, 2048)  # a probe: nothing drafted yet
    one.update(7, 0)
    one.drafts(7, 2048)  # parked, never run
    policy = one.policy
    assert (policy.parked, policy.drafting, policy.deepest) == (2, 0, 7)  # a parked policy's probe counts as parked
    one.abandon()
    assert (policy.parked, policy.drafting, policy.deepest) == (1, 0, 7)
    one, other = Pacing(scheduler, None, 7), Pacing(scheduler, None, 7)
    assert one.policy is other.policy
    one.drafts(7, 2048)
    other.drafts(7, 2048)
    other.update(0, 0)
    one.abandon()
    assert (policy.parked, policy.drafting, policy.deepest) == (3, 0, 7)


def tried(scheduler, drafts: int) -> None:
    """The drafter of ``drafts`` a round had a round before, which kept
    none: its next generation has rates to start from, not a guess
    (``YOUNG_ROUNDS``)."""
    recent = scheduler.recent_acceptance.setdefault(drafts, Acceptance(drafts))
    recent.update(drafts, 0)


class ParksThenDrafts:
    """A pacing that parks its first ``parked`` rounds, then drafts all it may."""

    def __init__(self, parked):
        self.left = parked

    def drafts(self, cap, depth):
        self.left -= 1
        return 0 if self.left >= 0 else cap

    def verifies(self, drafts, depth, drawn):
        pass

    def rows(self, tokens, depth):
        return tokens

    def measures(self, depth):
        return False

    def update(self, verified, accepted):
        pass

    def abandon(self):
        pass


@pytest.mark.parametrize("kind", ["dspark", "assistant"])
@pytest.mark.parametrize("at_most", [1, 4, 64])
def test_parked_rounds_leave_their_taps_to_the_drafters_next_draft(monkeypatch, kind, at_most):
    """A parked round does not have the drafter take in its taps: the
    drafter takes in a run of them in one call (``PARKED_TAPS_AT_MOST`` at
    most) before it next drafts, and drafts what it would have drafted
    taking them in round by round. The output is the target's. A generation
    that ends parked leaves the drafter's part of its prompt cache as round
    by round would have."""
    if kind == "assistant":
        _, model = case("dense")
        drafter = drafter_for("dense")
    else:
        model, drafter = trained("gemma4", kind)
    prompt, parked, max_tokens = [65, 211, 266, 241, 234, 10, 325, 168], 10, 24

    def run(at_most):
        monkeypatch.setattr(engine, "PARKED_TAPS_AT_MOST", at_most)
        monkeypatch.setattr(engine, "pacing_for", lambda *_: ParksThenDrafts(parked))
        commits, commit, propose = [], drafter.commit, drafter.propose

        def counting(cache, hidden, proposal=None):
            commits.append(hidden[0].shape[1])
            return commit(cache, hidden, proposal)

        def marking(*args, **kwargs):
            commits.append("draft")
            return propose(*args, **kwargs)

        monkeypatch.setattr(drafter, "commit", counting)
        monkeypatch.setattr(drafter, "propose", marking)
        ours, stats = speculative(model, drafter, prompt, max_tokens, scheduler="fixed")
        monkeypatch.undo()
        return ours, stats, commits

    ours, stats, commits = run(at_most)
    assert ours == plain_greedy(model, prompt, max_tokens)
    assert [r.proposed for r in stats.history[:parked]] == [0] * parked
    runs = [at_most] * (parked // at_most) + ([parked % at_most] if parked % at_most else [])
    first = commits.index("draft")
    assert commits[first - len(runs) : first] == runs
    assert sum(commits[: first - len(runs)]) == len(prompt)
    _, one_by_one, _ = run(1)
    assert [r.drafts for r in stats.history] == [r.drafts for r in one_by_one.history]
    if kind == "assistant":
        return  # its state holds no arrays of its own

    def drafter_part_after_parking(at_most):
        """The drafter's part of a prompt cache after a generation parked throughout."""
        monkeypatch.setattr(engine, "PARKED_TAPS_AT_MOST", at_most)
        monkeypatch.setattr(engine, "pacing_for", lambda *_: ParksThenDrafts(max_tokens))
        cache = mlx_dspark.make_prompt_cache(model, drafter)
        speculative(model, drafter, prompt, max_tokens, prompt_cache=cache, scheduler="fixed")
        monkeypatch.undo()
        return cache[-len(drafter.make_cache()) :]

    for ours, theirs in zip(drafter_part_after_parking(at_most), drafter_part_after_parking(1)):
        assert ours.offset == theirs.offset == len(prompt) + max_tokens
        for mine, round_by_round in zip(ours.state, theirs.state):
            if isinstance(mine, mx.array):
                assert mx.allclose(mine, round_by_round, atol=1e-5)
            else:
                assert mine == round_by_round


@given(
    prompt=st.lists(st.integers(5, 400), min_size=1, max_size=12),
    follow_up=st.lists(st.integers(5, 400), min_size=1, max_size=8),
    stop_after=st.integers(1, 20),
    how=st.sampled_from(["stop token", "max_tokens", "close"]),
)
def test_a_parked_stream_leaves_its_prompt_cache_exact(prompt, follow_up, stop_after, how):
    """However a parked generation ends, with the round after its last
    token built and never read, the prompt cache holds exactly the prompt
    and the tokens received, so the next turn equals a fresh run."""
    model, drafter = trained("gemma4", "dflash")
    reference = plain_greedy(model, prompt, stop_after)
    cache = mlx_dspark.make_prompt_cache(model, drafter)
    steps = speculative_generate_step(
        mx.array(prompt), model, drafter,
        max_tokens=stop_after if how == "max_tokens" else 40,
        stop_tokens=[reference[-1]] if how == "stop token" else [],
        prompt_cache=cache, scheduler=TableCostScheduler(None, 0.05, PARKED),
    )
    received = []
    for token, _, _ in steps:
        received.append(token)
        if how == "close" and len(received) == stop_after:
            steps.close()
    assert received == reference[: len(received)]
    assert cache[0].offset == cache[-1].offset == len(prompt) + len(received)
    turn2, _ = speculative(model, drafter, follow_up, 12, prompt_cache=cache)
    assert turn2 == plain_greedy(model, prompt + received + follow_up, 12)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "assistant"])
@given(
    prompt=st.lists(st.integers(5, 400), min_size=1, max_size=20),
    max_tokens=st.integers(1, 48),
    num_draft_tokens=st.integers(1, 4),
    draft=st.floats(0.0001, 0.02),
    verify=st.lists(st.floats(0.001, 0.05), min_size=16, max_size=16),
)
def test_every_pacing_is_lossless(kind, prompt, max_tokens, num_draft_tokens, draft, verify):
    """Random cost curves (so padding, parking and every number of drafts)
    over prompts and lengths that cross the sliding window."""
    if kind == "assistant":
        _, model = case("dense")
        drafter = drafter_for("dense")
    else:
        model, drafter = trained("gemma4", kind)
    temperatures = [1.0] * 4 if kind == "dspark" else None
    scheduler = TableCostScheduler(temperatures, draft, verify)
    ours, _ = speculative(
        model,
        drafter,
        prompt,
        max_tokens,
        num_draft_tokens=num_draft_tokens,
        scheduler=scheduler,
    )
    assert ours == plain_greedy(model, prompt, max_tokens)


@pytest.mark.parametrize(
    "name, draft, verify", [("padded", 0.001, JAGGED), ("parked", 0.05, JAGGED)]
)
def test_paced_sampling_keeps_the_targets_distribution(name, draft, verify):
    model, drafter = trained("gemma4", "dflash")
    sampler = mlx_dspark.make_sampler(temp=1.0)
    stats = SpeculativeStats(drafter.name, drafter.block_size)

    def sample():
        steps = speculative_generate_step(
            mx.array(PROMPT),
            model,
            drafter,
            max_tokens=6,
            sampler=sampler,
            stats=stats,
            scheduler=TableCostScheduler(None, draft, verify),
        )
        return [t for t, _, _ in steps][:3]

    counts = sample_runs(sample, 600, 3)
    drafted = sum(r.proposed for r in stats.history)
    assert stats.acceptance_rule == "rejection"
    assert (drafted > 0) == (name == "padded")
    expected = exact_distribution(model, {"temp": 1.0}, {}, 3)
    assert goodness_of_fit(counts, expected) > ALPHA


def test_without_a_scheduler_chosen_greedy_rounds_are_paced_and_park(monkeypatch, tmp_path):
    """A drafter loaded without a scheduler, the Gemma-4 assistant (which
    has none of its own) and a DSpark drafter alike, paces greedy rounds
    under ``cost``: where the costs measured on this machine (injected:
    drafting never pays, even if every draft were kept) say so, every round
    decodes plainly, and the output is the target's."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))

    def measured(timer, tokens=None, draft=True, repeats=REPEATS):
        return RoundCosts(0.002 if draft else 0.0, [PARKED[n - 1] for n in tokens])

    monkeypatch.setattr(RoundTimer, "__call__", measured)
    pairs = [trained("gemma4", "dspark"), trained("gemma4", "dflash")]
    pairs.append((case("dense")[1], drafter_for("dense")))
    for model, drafter in pairs:
        prompt = [65, 211, 266, 241, 234, 10, 325, 168]
        stats = SpeculativeStats(drafter.name, drafter.block_size)
        steps = speculative_generate_step(mx.array(prompt), model, drafter, max_tokens=24, stats=stats)
        assert [t for t, _, _ in steps] == plain_greedy(model, prompt, 24)
        assert stats.scheduler == "cost" and not any(r.drafts for r in stats.history)


def test_without_a_scheduler_chosen_one_seed_samples_one_text():
    """Sampled generations of a drafter loaded without a scheduler run
    every round with all its drafts (``fixed``), so one seed gives one text
    each time, as with mlx-lm's own decoding; under ``cost`` the rounds,
    and so where the random numbers are drawn, follow the machine's
    timings and the earlier generations."""
    model, drafter = trained("gemma4", "dflash")
    sampler = mlx_dspark.make_sampler(temp=0.8, top_p=0.95)
    texts = []
    for seed in (5, 5, 6):
        mx.random.seed(seed)
        stats = SpeculativeStats(drafter.name, drafter.block_size)
        steps = speculative_generate_step(
            mx.array([65, 211, 266, 241]), model, drafter, max_tokens=48, sampler=sampler,
            stats=stats,
        )
        texts.append([t for t, _, _ in steps])
        assert stats.scheduler == "fixed"
        assert all(len(r.drafts) == r.proposed for r in stats.history)
    assert texts[0] == texts[1] != texts[2]


def test_a_cost_chosen_per_call_goes_on_from_what_the_default_learnt():
    """A drafter loaded without a scheduler paces greedy generations with
    ``cost`` and leaves sampled ones to ``fixed``; a call that names
    ``cost`` (to pace a sampled generation too) goes on from the costs,
    acceptance and policy those generations learnt, and the default's next
    generations from what it learnt in turn; ``fixed`` named is ``fixed``.
    (On a table of costs under which drafting pays, untimed.)"""
    model, trained_drafter = trained("gemma4", "dflash")
    drafter = copy.copy(trained_drafter)  # its own default, as if loaded anew
    drafter.scheduler = default = TableCostScheduler(None, 0.001, [0.010] + [0.0105] * 15)
    default.paces_sampling = False
    prompt = mx.array([65, 211, 266, 241])
    list(speculative_generate_step(prompt, model, drafter, max_tokens=24))
    [(drafts, acceptance)] = default.recent_acceptance.items()
    [policy] = default.paced_policies.values()
    learnt, rounds = list(acceptance.verified), policy.drafting + policy.parked
    mx.random.seed(3)
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    steps = speculative_generate_step(
        prompt, model, drafter, max_tokens=24, sampler=mlx_dspark.make_sampler(temp=0.8),
        scheduler="cost", stats=stats,
    )
    assert len(list(steps)) == 24 and stats.scheduler == "cost"
    assert any(r.proposed for r in stats.history)
    assert acceptance.verified != learnt and policy.drafting + policy.parked > rounds
    assert list(default.paced_policies.values()) == [policy]
    assert isinstance(scheduler_for("fixed", drafter), FixedScheduler)


def test_a_generation_does_not_park_on_its_first_unlucky_round():
    """A drafter whose recent generations kept 6 of 7 drafts a round (plain
    rounds 10 ms, drafting ones 34: breaking even at 3.4 tokens). A new
    generation whose first round keeps none is not parked on that one round
    (its own estimate, with a prior of 2 rounds, falls to about 2.5 tokens):
    its first 3 rounds (``YOUNG_ROUNDS``) go by the better of its own rates
    and its drafter's. One that keeps none in every round parks after those
    3, no later."""
    curve = [0.010] + [0.030] * 15
    scheduler = TableCostScheduler(None, 0.004, curve)
    first = Pacing(scheduler, None, 7)
    for _ in range(60):
        first.update(first.drafts(7, 2048), 6)
    unlucky = Pacing(scheduler, None, 7)
    choices = []
    for accepted in [0, 7, 6, 7, 6, 7]:
        choices.append(unlucky.drafts(7, 2048))
        unlucky.update(choices[-1], accepted if choices[-1] else 0)
    assert choices == [7] * 6
    poor = Pacing(scheduler, None, 7)
    choices = []
    for _ in range(6):
        choices.append(poor.drafts(7, 2048))
        poor.update(choices[-1], 0)
    assert choices == [7, 7, 7, 0, 0, 0]
