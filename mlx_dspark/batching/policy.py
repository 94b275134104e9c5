"""How many drafts a speculative batch verifies each round.

A round of ``B`` sequences with ``k`` drafts each costs one drafter call and
one target forward of ``B x (k + 1)`` rows; sequence ``b`` then emits
``1 + Σ_{i<=k} Π_{j<=i} a_bj`` tokens on average, ``a_bj`` being its chance
of accepting draft ``j`` once ``1..j-1`` were accepted. The policy picks the
``k`` (``0``: plain batched decoding, the drafter idle) with the most
expected tokens per second for the whole batch (of those about as fast,
``NEAR_BEST``, the most drafts). As the batch grows, the
verify of ``k + 1`` rows per sequence costs more against one row, and the
best ``k`` falls towards 0.

The measured costs time each forward on its own; a round in the generator
also pays the host's work (building the round's graphs, reading it, the
responses) and the drafter taking in what was kept. So the policy also
learns, per batch size, how much longer rounds with and without drafts
really take than the measurements predicted (``observe``, the fastest of
recent rounds), and adds that to the costs (a kind a batch size has not run
yet takes another size's, see ``_overheads``): a batch where drafting looks
cheap on paper but is slow in practice parks. The overhead is added, not
multiplied: the host's work is much the same whatever the rows verified,
and the server does it between the rounds' device work, not during it. A
count of drafts whose rounds were timed also pays what they took beyond
that overhead (``beyond``): the measured drafting cost can grow faster with
the drafts than a round's does. (As
a ratio it made every further draft look dearer than it is: on the H200
at 12B shapes, rounds at one sequence took 35 ms beyond their forwards, and
the policy verified 3 drafts where 7 paid.)

With a calibrated drafter (a confidence head and fitted temperatures) the
policy also looks at the round's own drafts before they are verified
(``truncate``): from each sequence's predicted survival of its drafts it
verifies one more draft position for the whole batch while that raises
the expected tokens per second, or would with the positions after it, and
stops at the first position where neither would (the batched form of the
paper's Algorithm 1 for one forward of ``B x (k + 1)`` rows).

A round drafts and verifies the same number of drafts for every sequence;
one whose budget allows fewer judges only those, and the rest is padding.
Where more rows cost about the same (``round_width``), a round pads to the
most of them: on MLX-CUDA a round whose shape changed (batch size, drafts
verified) took 40-70 ms more than the rounds around it, even for a shape
run before (``benchmarks/batch_phases.py --shapes``), and the budgets of
requests near their end would otherwise change it round after round. The
policy learns what a change costs on this machine and changes a round's
drafts or width only where that pays (``SWITCH_ROUNDS``).

Losslessness when sampling (paper, Appendix A): ``choose`` uses only what
was known before the round's drafts were drawn, namely the earlier rounds'
acceptance and times, and the measured costs; ``truncate`` decides whether
position ``j`` is verified from the confidences up to ``j`` of every
sequence (a sequence's own confidence ``z_j`` sees its drafts before ``j``
only), never from a later position.
"""

import dataclasses
import logging
import statistics
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul
from typing import Callable, List, Optional, Sequence, Union

from ..confidence.costs import RoundCosts
from ..confidence.schedulers import survival_ahead

# Every this many rounds at k = 0 at least, one round drafts again:
# acceptance changes over a conversation, and a parked policy learns
# nothing new.
REPROBE_EVERY = 16

# A probe costs what its rounds lose against plain ones, so a parked policy
# probes every ``REPROBE_EVERY`` rounds times the least power of two (up to
# ``REPROBE_AT_MOST`` rounds) that keeps that loss within this share of the
# parked rounds' time. (On the H200 at 12B shapes a 4-bit target's drafting
# round took 4-5 plain rounds' time; probing every 16 rounds, a single
# stream at tau 1.5 served 0.65x of plain decoding.) Powers of two, so that
# a longer interval's probes fall where a shorter one's do.
PROBE_SHARE = 0.03
REPROBE_AT_MOST = 16 * REPROBE_EVERY

# A probe lasts this many rounds where rounds' times are observed and the
# probed kind was timed before (else ``LEARNING_ROUNDS``): its first
# changes the round's shape, which costs that round one-off work (on MLX-CUDA
# 40-70 ms even for a shape run before; in a batch its drafter also takes in
# the parked rounds), so only the rounds after it show what the probed kind
# costs. (A single stream's pacing without a clock observes no times: its
# probes learn acceptance, one round each.)
PROBE_ROUNDS = 2

# The first rounds of each shape (batch size and drafts verified) pay
# one-off work (kernels compiled for the new shapes, a few hundred ms each
# on CUDA; buffers allocated; the cost measurements' after-effects): not
# observed. After them, a kind's (with drafts or without) overhead beyond
# the prediction is that of the fastest of its last few rounds, as the
# measured costs are the fastest of their repeats: a round is slowed by
# many things (a shape's later first uses, such as a cache grown past a new
# size; the host busy elsewhere). So slow rounds seen while a server warms up do not keep a
# kind observed rarely (drafting while parked) looking slow until several
# probes have replaced them: the first probe as fast as measured does. (The
# generator times a pipelined round from the read of the round before it,
# and not at all when it may have been done before the host came back, so
# that it does not look almost free.)
WARM_ROUNDS = 2
RECENT_ROUNDS = 5

# A count of drafts' own overhead (``BatchPolicy.beyond``) is forgotten once
# this many drafting rounds of the batch size were timed since its last: a
# count weighed as slow is then tried again, as the drafting overhead says.
FORGET_AFTER = 32

# A probe of a kind no round of which was timed yet (at any batch size, or
# at this one where it timed the other kind) lasts until one is, this many
# rounds at most: its shape's first rounds warm up, and in a batch its last
# round's read also builds the next round, which takes in the parked rounds'
# taps, so a probe of ``PROBE_ROUNDS`` would observe nothing, and a fresh
# server would probe every ``REPROBE_EVERY`` rounds for several requests.
# Pipelined, the observation arrives a round late: a probe of
# ``WARM_ROUNDS + 2`` rounds where every round is timed.
LEARNING_ROUNDS = 2 * (WARM_ROUNDS + 1)


# On MLX-CUDA a round whose shape changed (batch size, drafts verified)
# took 40-70 ms more than the rounds around it, even for a shape run before
# (``benchmarks/batch_phases.py --shapes``); on the H200 at 12B shapes the
# cost policy, choosing 5-7 drafts round by round where ``fixed`` kept 7,
# served 0.68-1.27x its tokens/s (0.97x over 12 pairs). The policy learns what a change of shape
# costs here (``observe``) and changes a round's drafts only where the
# change pays for itself within this many rounds.
SWITCH_ROUNDS = 8

# Draft counts whose expected speeds are this near are as fast within the
# noise of the measured costs, which decides between them at random. The
# round drafts the most of them: as many tokens per round or more, for next
# to nothing where the verify's rows cost next to nothing (a GPU), and the
# same few round shapes round after round rather than a new one, whose first
# use compiles kernels on MLX-CUDA.
NEAR_BEST = 0.03


# How much a sequence's acceptance counts decay each round: a memory of
# about 30 rounds. Where drafting pays by a fifth or so, a shorter one parks
# on a few poor rounds and stays parked (nothing is learnt while parked): on
# the H200 of session 21 a 4-bit target's DSpark stream at tau 3.3 (each
# draft kept at 0.7), paced with a memory of 10 rounds, parked in most
# rounds and served 0.66-0.74x plain where drafting every round (``fixed``)
# served 1.30-1.35x. Replayed on its measured costs, such a stream parks in
# about a third of its rounds at 0.9 and a tenth at 0.97.
DECAY = 0.97

# A sequence's first rounds are too few to park on: until it has read this
# many, its rounds are chosen by the better of its own rates and those it
# started from, its drafter's recent ones, or, where its drafter had
# verified no draft yet (a fresh process's first generation), as if every
# draft were kept (``Acceptance.round_rates``). A newcomer's rates carry a
# prior of 2 rounds, so one round that kept none of 7 drafts took a tau-6
# generation's estimate to 2.5 and parked it, with its next probe 128-256
# rounds away: often the rest of the generation. Replayed on session 34's
# H200 4-bit DSpark costs (``benchmarks/pacing_sim.py``; BENCHMARKS.md,
# sessions 34 and 35) a stream at tau 6 served 1.43x plain decoding, 1.50x
# with this, and a fresh one at tau 4.5 1.10x, 1.12x with this; where
# drafting does not pay, 1% less at most.
YOUNG_ROUNDS = 3


@dataclass
class Acceptance:
    """Counts of verified and accepted drafts by position, with a prior of
    ``prior_weight`` rounds at rate ``prior``; recent rounds weigh more
    (each count decays by ``decay`` per update).

    ``prior`` is one rate, or one per position (a newcomer's: the drafter's
    recent rates). It is the prior of the first position only; a later
    position's is its own scaled by how far the position before it moved
    from its prior (one rate: the rate of the position before it). So a
    position rarely or never verified is worth what the drafts before it
    earned, not a fixed guess: with 0.5 for every position, a policy that
    verified fewer drafts than it could (a fresh one's first rounds at the
    prior, where 0.5 makes each further draft worth little) valued the
    drafts it never verified at 0.5 for good, and kept drafting fewer
    (likely why, on an H100 at 12B shapes, the batched assistant at tau
    3.3, each draft kept at 0.73, drafted 4.1-4.7 a round under ``cost``
    against ``fixed``'s 5.6, at 0.94-0.96x its tokens/s).
    """

    positions: int
    prior: Union[float, Sequence[float]] = 0.5
    prior_weight: float = 2.0
    decay: float = DECAY
    verified: List[float] = field(default_factory=list)
    accepted: List[float] = field(default_factory=list)
    read: int = field(default=0, init=False)  # rounds whose verdicts were read (``update``)
    untried: bool = False  # its drafter had verified no draft when it started

    def __post_init__(self):
        self.verified = [0.0] * self.positions
        self.accepted = [0.0] * self.positions
        if isinstance(self.prior, (int, float)):
            self.prior = [self.prior] * self.positions

    def update(self, proposed: int, accepted: int) -> None:
        self.read += 1
        for j in range(min(proposed, self.positions)):
            self.verified[j] = self.decay * self.verified[j] + 1.0
            self.accepted[j] = self.decay * self.accepted[j] + (j < accepted)
            if j >= accepted:
                break

    def expect(self, first: int, rates: Sequence[float]) -> None:
        """A round's drafts from position ``first`` on were drawn and not
        verified (its drafter's confidences said they would not pay), after
        every verified one was accepted; ``rates``: each one's calibrated
        chance of being kept once those before it were. Each counts as one
        verify of its position, kept at that chance. (Weighed by the chance
        that a verify would have reached it, a later position would keep
        its old rate for as long as the first draft's rate stayed low, and
        drafting would look as if it paid.) Without it a stream whose
        acceptance fell would go on drafting at its old rates and verifying
        nothing, learning nothing (on an H200 a 4-bit 12B DSpark stream at
        tau 1.5, after its generations at tau 3.3 and 6, drafted in each of
        381 rounds and verified none, at 0.61x plain decoding)."""
        for j, rate in zip(range(first, self.positions), rates):
            self.verified[j] = self.decay * self.verified[j] + 1.0
            self.accepted[j] = self.decay * self.accepted[j] + rate

    def rates(self) -> List[float]:
        """``a_j``: P(draft j accepted | drafts before it accepted)."""
        w = self.prior_weight
        rates = []
        for j, (v, a, prior) in enumerate(zip(self.verified, self.accepted, self.prior)):
            if j and self.prior[j - 1] > 0:
                prior = min(1.0, prior * rates[-1] / self.prior[j - 1])
            rates.append((a + w * prior) / (v + w))
        return rates

    def round_rates(self, drafts: int) -> List[float]:
        """The rates a round of up to ``drafts`` drafts is chosen by: its
        own, or until ``YOUNG_ROUNDS`` rounds were read the prior it started
        from where that expects more tokens (every draft kept, where its
        drafter had verified none). (Rounds read, not chosen: a pipelined
        round is chosen before the one before it is read.)"""
        own = self.rates()
        if self.read >= YOUNG_ROUNDS:
            return own
        if self.untried:
            return [1.0] * self.positions
        return max(own, self.prior, key=lambda rates: expected_tokens(rates, drafts))

    def newcomer(self) -> "Acceptance":
        """A new sequence's acceptance, starting from this one's rates: a
        request's first rounds then draft as the drafter's recent rounds
        (of other requests) say they pay, not from a fixed guess."""
        return Acceptance(
            self.positions, self.rates(), self.prior_weight, self.decay, untried=not any(self.verified)
        )


def interpolate(measured: dict, batch: int) -> RoundCosts:
    """Round costs for ``batch`` sequences from those ``measured`` at other
    batch sizes: linear between the nearest below and above, else the
    nearest one."""
    below = max((b for b in measured if b <= batch), default=None)
    above = min((b for b in measured if b >= batch), default=None)
    if below is None or above is None or below == above:
        return measured[below if above is None else above]
    t = (batch - below) / (above - below)
    low, high = measured[below], measured[above]
    one = None
    if low.draft_one is not None and high.draft_one is not None:
        one = (1 - t) * low.draft_one + t * high.draft_one
    return RoundCosts(
        draft=(1 - t) * low.draft + t * high.draft,
        verify=[(1 - t) * a + t * b for a, b in zip(low.verify, high.verify)],
        draft_one=one,
        drafts=low.drafts,
    )


def expected_tokens(rates: Sequence[float], drafts: int) -> float:
    """Tokens a round of ``drafts`` drafts emits on average."""
    total, survive = 1.0, 1.0
    for a in rates[:drafts]:
        survive *= a
        total += survive
    return total


def best_drafts(
    rates: Sequence[Sequence[float]], caps: Sequence[int], costs: RoundCosts,
    keep: Optional[int] = None, switch: float = 0.0,
    width: Optional[Callable[[int], int]] = None, beyond: Optional[dict] = None,
) -> int:
    """The ``k`` in ``0..max(caps)`` with the most expected tokens per second
    for the batch (sequence ``b`` verifies ``min(k, caps[b])`` drafts, and
    the round drafts and verifies ``width(k)`` for each, by default ``k``:
    see ``round_width``); when that is a drafting round, the most drafts
    within ``NEAR_BEST`` of it and faster than plain decoding. Where a
    change of shape costs ``switch`` seconds, a round whose width is not
    ``keep`` (the round before's) pays them, and a ``k`` verified at
    ``keep`` stays wherever it is within ``NEAR_BEST`` of the best.
    ``beyond``: seconds a round of a given width takes beyond ``costs``
    (``BatchPolicy.beyond``)."""
    speeds, widths = [], []
    top = min(max(caps, default=0), len(costs.verify) - 1)
    # Each sequence's expected tokens by drafts, in one pass (every round
    # weighs this, a parked single stream's too).
    emitted = [
        list(accumulate(accumulate(r[: min(c, top)], mul), initial=1.0))
        for r, c in zip(rates, caps)
    ]
    for k in range(top + 1):
        w = width(k) if k and width else k
        seconds = costs.verify[w] + costs.drafting(w) + (switch if w != keep else 0.0)
        seconds += (beyond or {}).get(w, 0.0)
        tokens = sum(e[min(k, len(e) - 1)] for e in emitted)
        speeds.append(tokens / seconds)
        widths.append(w)
    near = max(speeds, default=0.0) * (1 - NEAR_BEST)
    drafting = [k for k, speed in enumerate(speeds) if k and speed > speeds[0] and speed >= near]
    kept = [k for k in drafting if widths[k] == keep]
    if switch and kept:
        return max(kept)
    return max(drafting, default=0)


def round_width(
    drafts: int, most: int, costs: RoundCosts, keep: Optional[int] = None, switch: float = 0.0
) -> int:
    """How many drafts a round drafts and verifies for each sequence when
    ``drafts`` at most are judged: of the counts up to ``most`` whose
    verify costs within ``NEAR_BEST`` of the cheapest at least as long, the
    most; where a change of shape costs ``switch`` seconds, a count other
    than ``keep`` (the round before's) pays them, and ``keep`` stays where
    it is one of those counts. Where rows cost next
    to nothing (a GPU), a round keeps one shape whatever its sequences'
    budgets allow; where more rows cost less (a kernel switch), it takes the
    cheaper count."""
    top = min(most, len(costs.verify) - 1)
    if drafts == 0 or top <= drafts:
        return drafts
    widths = range(drafts, top + 1)
    seconds = {w: costs.verify[w] + (switch if w != keep else 0.0) for w in widths}
    cheapest = min(seconds.values())
    near = [w for w in widths if seconds[w] <= cheapest * (1 + NEAR_BEST)]
    return keep if switch and keep in near else max(near)


def confident_drafts(
    survival: Sequence[Sequence[float]], caps: Sequence[int], costs: RoundCosts
) -> int:
    """How many of a drafted round's positions to verify: ``survival[b][j-1]``
    is sequence ``b``'s predicted chance that its drafts ``1..j`` all
    survive, and the drafts are already paid for. Extends the verify by one
    position for every sequence that has it while the round's expected
    tokens per second rise, or would with the positions after it (each
    sequence's predicted by ``survival_ahead``, which crosses a verify's
    cost cliff), and stops at the first position that would not (so
    position ``j``'s fate depends on positions up to ``j`` only)."""
    top = min(max(caps, default=0), len(costs.verify) - 1)
    tokens = float(len(caps))
    k, current = 0, tokens / (costs.draft + costs.verify[0])
    for j in range(1, top + 1):
        gained = sum(s[j - 1] for s, cap in zip(survival, caps) if cap >= j)
        pays = (tokens + gained) / (costs.draft + costs.verify[j]) > current
        if not pays and not _pays_further(survival, caps, costs, j, top, tokens, current):
            break
        tokens += gained
        k, current = j, tokens / (costs.draft + costs.verify[j])
    return k


def _pays_further(survival, caps, costs, j, top, tokens, current) -> bool:
    """Whether verifying positions ``j`` to ``j + m - 1`` for some ``m`` of
    2 or more (up to ``top``), each sequence's later positions predicted by
    ``survival_ahead``, would beat ``current`` tokens per second (only worked out where position ``j``
    alone does not: it is the round's host work before its verify)."""
    ahead = [0.0] * (top - j + 1)  # expected tokens at positions j..top
    for row, cap in zip(survival, caps):
        if cap >= j:
            for i, a in enumerate(survival_ahead(row, j, min(cap, top))):
                ahead[i] += a
    return any(
        (tokens + sum(ahead[:m])) / (costs.draft + costs.verify[j + m - 1]) > current
        for m in range(2, len(ahead) + 1)
    )


def _probing(rounds: int, length: int, every: int = REPROBE_EVERY) -> bool:
    """Whether the ``rounds``-th round of a kind is part of a probe of the
    other kind: the first ``length`` of every ``every``."""
    return rounds >= every and rounds % every < length


def reprobe_every(loss: float, plain: float, length: int) -> int:
    """Parked rounds of ``plain`` seconds from one probe of ``length``
    rounds, each ``loss`` seconds slower than plain rounds would have been,
    to the next (see ``PROBE_SHARE``)."""
    every = REPROBE_EVERY
    while every < REPROBE_AT_MOST and length * loss > PROBE_SHARE * every * plain:
        every *= 2
    return every


def _nearest(sizes, batch: int) -> Optional[int]:
    """The size in ``sizes`` nearest ``batch`` (the smaller of two as near)."""
    return min(sizes, key=lambda b: (abs(b - batch), b), default=None)


class BatchPolicy:
    """Chooses each round's number of drafts from measured round costs,
    corrected by the rounds' realised times.

    Args:
        costs: ``costs(batch, depth) -> RoundCosts`` for a batch of
            ``batch`` sequences at context depth ``depth``; by default the
            generator measures them on its live caches
            (``SpeculativeBatchGenerator.measured_costs``).
        probe_first: A parked policy probes at once, not only after
            ``REPROBE_EVERY`` parked rounds, whenever its probe would draft
            further than any of its rounds did: no round of its own tried
            those positions, whose acceptance may be the prior's alone. For
            a single stream, whose process may decode one generation only
            (``mlx_lm.generate``): on an H200 a fresh 4-bit 12B stream
            parked on the prior first probed after 255 rounds, longer than
            many a whole generation. (Not "never drafted": on a machine
            whose costs a first generation measures as it goes, its first
            rounds see one or two verify lengths, and a round of one draft
            there would be its only one. A sequence whose drafter verified
            no draft drafts its first rounds anyway, ``YOUNG_ROUNDS``; what
            is left to this is a round deeper than any drafted so far.)
    """

    name = "cost"

    def __init__(
        self, costs: Optional[Callable[[int, int], RoundCosts]] = None, probe_first: bool = False
    ):
        self.costs = costs
        self.probe_first = probe_first
        self.parked = 0
        self.drafting = 0
        self.deepest = 0  # the most drafts any round chosen had
        # (batch size, drafted) -> seconds a round takes beyond its
        # predicted forwards.
        self.overheads = {}
        # (batch size, drafts) -> rounds seen; (batch size, drafted) -> the
        # recent overheads.
        self._seen = Counter()
        self._recent = defaultdict(lambda: deque(maxlen=RECENT_ROUNDS))
        # (batch size, drafts) -> the recent overheads of drafting rounds
        # of that many drafts, and the batch size's count of timed drafting
        # rounds at the last of them (``beyond``).
        self._by_drafts = defaultdict(lambda: deque(maxlen=RECENT_ROUNDS))
        self._timed_at = {}
        self._timed = Counter()
        # (batch size, drafts verified, drafted, predicted seconds) of each
        # round chosen and not yet observed, oldest first (no prediction:
        # nobody could draft, nothing measured to learn against).
        self._chosen = deque()
        # What a change of the round's shape costs beyond its kind's
        # overhead (the median of the recent changes: one noisy change
        # does not make them free), the shape of the
        # round last chosen and of the one last observed, and the current
        # round's (drafts to keep, seconds a change pays).
        self.switch_cost = 0.0
        self._switches = deque(maxlen=RECENT_ROUNDS)
        self._shape = None
        self._observed_shape = None
        self._keep = (None, 0.0)
        self._was_parked = None
        self._reprobe = REPROBE_EVERY  # the parked rounds from one probe to the next
        self._observed = False  # whether rounds' times are observed at all

    def newcomer(self) -> "BatchPolicy":
        """A policy for another stream of the same drafter and target (a
        single stream on another thread), starting from what this one
        learnt of the rounds' real costs, not from nothing."""
        policy = BatchPolicy(probe_first=self.probe_first)
        policy.deepest = self.deepest
        policy.overheads = dict(self.overheads)
        policy._seen = Counter(self._seen)
        for kind, recent in self._recent.items():
            policy._recent[kind].extend(recent)
        for shape, recent in self._by_drafts.items():
            policy._by_drafts[shape].extend(recent)
        policy._timed_at = dict(self._timed_at)
        policy._timed = Counter(self._timed)
        policy.switch_cost = self.switch_cost
        policy._switches.extend(self._switches)
        policy._observed = self._observed
        return policy

    def choose(
        self, rates, caps, depth: int, batch: Optional[int] = None, most: Optional[int] = None
    ) -> int:
        """``k`` for the live sequences' ``rates`` and ``caps``; ``batch``:
        the rows the round verifies, finished ones riding along included
        (by default one per live sequence); ``most``: the most drafts any
        of them may verify, which a round pads its drafts up to (``width``);
        without it each count is weighed unpadded (a single stream pads on
        its own, see ``speculative.pacing``)."""
        batch = batch or len(caps)
        if not caps or max(caps) == 0:
            self._shape = (batch, 0) if caps else None
            self._chosen.append(self._shape and (batch, 0, False, None))
            return 0
        measured = self.costs(batch, depth)
        costs = self.realised(measured, batch)
        self._keep = self._keeping(batch)
        width = None
        if most:
            width = lambda k: round_width(k, most, measured, *self._keep)  # noqa: E731
        k = best_drafts(rates, caps, costs, *self._keep, width=width, beyond=self.beyond(batch))
        self._log_switch(k, max(caps), batch, depth, costs)
        if k:
            self.parked = 0
            self.drafting += 1
            # A policy whose rounds are timed but never ran plain does not
            # know what that really costs: try plain rounds until it does.
            if self._learning(batch, drafted=False) and _probing(self.drafting, LEARNING_ROUNDS):
                k = 0
        else:
            # Parked. Probe now and then, with the drafts that would pay if
            # every draft were accepted; none would: nothing to learn.
            hopeful = best_drafts([[1.0] * max(caps)] * len(caps), caps, costs)
            self.parked += 1
            if hopeful:
                length = self._probe_rounds(batch)
                if not _probing(self.parked, length, self._reprobe):
                    # What a probe round loses, at the acceptance the policy
                    # parked on, with its share of the probe's two changes
                    # of shape (into drafting and back; on the H200 20-40
                    # ms each, more than a probe round's own loss). (Not
                    # re-weighed within a probe, which its first round's
                    # acceptance would otherwise cut short.)
                    tokens = sum(expected_tokens(r, min(hopeful, c)) for r, c in zip(rates, caps))
                    plain = costs.verify[0]
                    loss = costs.verify[hopeful] + costs.drafting(hopeful) - tokens * plain / len(caps)
                    loss += 2 * self.switch_cost / length
                    self._reprobe = reprobe_every(loss, plain, length)
                first = self.probe_first and hopeful > self.deepest
                if first or _probing(self.parked, length, self._reprobe):
                    k = hopeful
        self.deepest = max(self.deepest, k)
        predicted = measured.verify[k] + measured.drafting(k)
        self._chosen.append((batch, k, k > 0, predicted))
        self._shape = (batch, k)
        return k

    def restart(self, chosen: Optional[deque] = None) -> deque:
        """A single stream's generation takes its turn: the rounds it chose
        and has not observed (by default none, a new generation) are the
        ones ``observe`` times next, not another generation's (it may have
        ended between the two, or be advanced in turn with this one)."""
        self._chosen = deque() if chosen is None else chosen
        return self._chosen

    def _keeping(self, batch: int):
        """The drafts of the round before, where it had ``batch`` rows, and
        the seconds a round of another shape pays for the change."""
        if self._shape is None or self._shape[0] != batch:
            return None, 0.0
        return self._shape[1], self.switch_cost / SWITCH_ROUNDS

    def _probe_rounds(self, batch: int) -> int:
        """How long a parked policy's probe of drafting lasts (see
        ``PROBE_ROUNDS`` and ``LEARNING_ROUNDS``)."""
        if not self._observed:
            return 1
        return LEARNING_ROUNDS if self._learning(batch, drafted=True) else PROBE_ROUNDS

    def _learning(self, batch: int, drafted: bool) -> bool:
        """Whether rounds are timed and ``batch`` has yet to time a round of
        this kind that it needs: none was timed at any batch size, or
        ``batch`` timed the other kind only, and its own pair would replace
        a neighbour's (``_overheads``)."""
        if not self._observed or (batch, drafted) in self.overheads:
            return False
        return self._overhead(batch, drafted) is None or (batch, not drafted) in self.overheads

    def _log_switch(self, k, cap, batch, depth, costs):
        """A debug line whenever the policy starts or stops drafting: what
        it predicted, and the overheads (ms) behind it."""
        if (k == 0) == self._was_parked:
            return
        self._was_parked = k == 0
        shown = k or min(cap, len(costs.verify) - 1)
        drafted = f", {shown} drafts {1000 * (costs.verify[shown] + costs.drafting(shown)):.1f} ms" if shown else ""
        overheads = {
            f"{b} {'drafted' if d else 'plain'}": round(1000 * o, 1) for (b, d), o in self.overheads.items()
        }
        logging.debug(
            "Batch policy %s at batch %d, depth %d: a round predicted plain "
            "%.1f ms%s; overheads %s, a change of shape %.1f ms",
            "drafts" if k else "parks",
            batch,
            depth,
            1000 * costs.verify[0],
            drafted,
            overheads,
            1000 * self.switch_cost,
        )

    def truncate(
        self, survival, caps, depth: int, batch: Optional[int] = None, drawn: Optional[int] = None
    ) -> int:
        """The drafts to verify of a round ``choose`` decided to draft, from
        their predicted survival (``confident_drafts``); the round is then
        observed against the costs of what it verifies."""
        batch = batch or len(caps)
        measured = self.costs(batch, depth)
        # Its drafts are drawn: verifying none of them is still a drafting
        # round, which pays the drafting rounds' overhead (in ``draft``), not
        # a plain round's as well.
        drawn = drawn or max(caps, default=0)
        realised = self.realised(measured, batch)
        realised = RoundCosts(realised.drafting(drawn), measured.verify)
        k = confident_drafts(survival, caps, realised)
        self.verifies(k, measured, batch, drawn)
        return k

    def verifies(
        self, drafts: int, measured: RoundCosts, batch: int = 1, drawn: Optional[int] = None
    ) -> None:
        """The round drew ``drawn`` drafts (by default as many as it
        verifies) and verifies ``drafts`` of them (not what was chosen): it
        is observed against ``measured`` costs of that."""
        if self._chosen and self._chosen[-1] is not None:
            seconds = measured.verify[drafts] + measured.drafting(max(drawn or drafts, 1))
            self._chosen[-1] = (batch, drafts, True, seconds)
        self._shape = (batch, drafts)

    def width(self, drafts: int, most: int, depth: int, batch: int) -> int:
        """How many drafts each sequence drafts and verifies when at most
        ``drafts`` are judged (``round_width``); the round is observed at
        that width."""
        measured = self.costs(batch, depth)
        width = round_width(drafts, most, measured, *self._keep)
        self.verifies(width, measured, batch)
        return width

    def realised(self, costs: RoundCosts, batch: int) -> RoundCosts:
        """``costs`` with what this batch size's rounds (or the nearest
        batch size's) really took beyond them added, with drafts (to the
        drafter's cost, which every drafting round pays) and without."""
        drafting, plain = self._overheads(batch)
        # A plain round's host work is part of a drafting round's: more
        # overhead than that is a few slow rounds, which a drafting policy
        # would not run again to learn better. (On an H200 a 4-bit 12B
        # stream whose first plain rounds were slow drafted for 250 rounds
        # at no acceptance at all, at half plain decoding's speed.)
        plain = min(plain, drafting)
        # A plain round's shortfall (see ``observe``) was learnt at another
        # depth or batch size, maybe: never more than half of this one's.
        plain = max(plain, -costs.verify[0] / 2)
        return dataclasses.replace(
            costs,
            draft=costs.draft + drafting,
            draft_one=None if costs.draft_one is None else costs.draft_one + drafting,
            verify=[costs.verify[0] + plain] + list(costs.verify[1:]),
        )

    def beyond(self, batch: int) -> dict:
        """Drafts -> seconds a drafting round of that many drafts at
        ``batch`` took beyond the drafting rounds' overhead (the fastest of
        its recent rounds against the fastest of the batch size's recent
        drafting rounds), where such rounds were timed lately
        (``FORGET_AFTER``) and ``batch`` has both overheads of its own (a
        neighbour's, which ``realised`` may add, was learnt elsewhere). The
        measured drafting cost can grow faster with
        the drafts than it does in a round, where the host builds a draft's
        step while the device runs the one before: on an H100 at 12B shapes
        the Gemma-4 assistant's rounds of 2 drafts took 5-7 ms more than
        their measured costs, rounds of 6 only 2.5-3 ms more, and a single
        stream kept 2 drafts a round (one overhead for both looked 6 only
        2% faster, within ``NEAR_BEST``) where 6 were 19% faster."""
        if (batch, False) not in self.overheads or (batch, True) not in self.overheads:
            return {}
        overhead = self.overheads[batch, True]
        return {
            drafts: min(recent) - overhead
            for (b, drafts), recent in self._by_drafts.items()
            if b == batch and self._timed[batch] - self._timed_at[b, drafts] <= FORGET_AFTER
        }

    def _overheads(self, batch: int):
        """The overheads of rounds with drafts and without for ``batch``:
        both from the nearest batch size that ran both kinds (``batch``
        itself where it did, and one that ran one kind probes the other, see
        ``_learning``), whose two overheads were learnt alike; else
        each kind's from the nearest size that ran it, none where nothing
        is known. Parking rests on their difference, which one kind's from
        one size and the other's from another does not keep: the host's work
        grows with the batch, and a kind seen only while the server warmed
        up keeps its slow rounds the longest. (On the H200 a lone request
        weighed one sequence's own drafting overhead, 29 ms, against eight
        sequences' plain one, none, and parked where drafting paid.)"""
        known = self.overheads
        both = {b for b, _ in known if (b, True) in known and (b, False) in known}
        paired = _nearest(both, batch)
        if paired is not None:
            return known[paired, True], known[paired, False]
        overheads = [self._overhead(batch, drafted) for drafted in (True, False)]
        return tuple(0.0 if o is None else o for o in overheads)

    def _overhead(self, batch: int, drafted: bool) -> Optional[float]:
        """The overhead of rounds of this kind at the nearest batch size
        that has one, or ``None``: a batch size the server has not run yet
        starts from its neighbour's overhead, not from none."""
        nearest = _nearest({b for b, d in self.overheads if d == drafted}, batch)
        return None if nearest is None else self.overheads[nearest, drafted]

    def observe(self, seconds: Optional[float]) -> None:
        """The realised time of the oldest round chosen and not yet
        observed (the generator reads rounds in the order they were
        chosen); ``None`` for a round whose time is not its own (it also
        did work deferred from other rounds). A round nobody could draft in
        teaches nothing but its shape: the next round that drafts changes it."""
        self._observed = True
        chosen = self._chosen.popleft() if self._chosen else None
        before, self._observed_shape = self._observed_shape, chosen and chosen[:2]
        if chosen is None or seconds is None or chosen[3] is None:
            return
        batch, drafts, drafted, predicted = chosen
        self._seen[batch, drafts] += 1
        if self._seen[batch, drafts] <= WARM_ROUNDS:
            return
        kind = (batch, drafted)
        # A drafting round's shortfall is no overhead: the measurements'
        # noise. A plain round's can be real: built while the round before
        # it ran (as mlx-lm's plain decoding pipelines its steps), it is
        # timed from that round's read, and its building is hidden, where
        # the measured costs time each forward built and run in turn. Two
        # pieces of work overlapped take at least half their sum.
        excess = max(0.0 if drafted else -predicted / 2, seconds - predicted)
        if before not in (None, (batch, drafts)) and kind in self.overheads:
            # The round changed the shape: what the change cost here.
            # Not the kind's overhead: where most rounds change the shape,
            # the changes would become it, and the policy park for good.
            self._switches.append(max(0.0, excess - self.overheads[kind]))
            self.switch_cost = statistics.median(self._switches)
            return
        self._recent[kind].append(excess)
        self.overheads[kind] = min(self._recent[kind])
        if drafts:  # (a drafting round that verified none is no count's)
            self._timed[batch] += 1
            self._by_drafts[batch, drafts].append(excess)
            self._timed_at[batch, drafts] = self._timed[batch]


class FixedPolicy:
    """Every sequence verifies as many drafts as it may."""

    name = "fixed"

    def choose(
        self, rates, caps, depth: int, batch: Optional[int] = None, most: Optional[int] = None
    ) -> int:
        return max(caps, default=0)


POLICIES = {"cost": BatchPolicy, "fixed": FixedPolicy}
