"""How many drafts a single stream's round proposes, and how many rows it
verifies.

Under the ``cost`` scheduler a generation is a speculative batch of one: each
round proposes the number of drafts with the most expected tokens per second
(of those about as fast, the most) from the recent acceptance by position and
the measured round costs, and 0 (a plain decode step, the drafter idle) when
speculating is slower; a parked
generation re-probes now and then (``batching.policy``). The verify then runs
at the row count ``RoundCosts.cheapest_rows`` picks for ``[anchor, drafts]``
(more rows only where clearly cheaper), padded after the drafts: attention is causal, so the real rows' logits are the same,
and the padding's outputs are discarded and its cache entries rolled back.

At a depth whose costs are not measured yet, each round measures the next
two verify lengths on the live caches (``VERIFIES_MEASURED_PER_ROUND``) and
drafts, verifies and pads within the lengths measured so far, rather than
stopping for all 16.

Each round is timed on the scheduler's ``clock``, from its choice (or the
read of the round before, for a round chosen before that read) to its
verdict read, and the policy learns what rounds with drafts and without
really take beyond their measured costs (``BatchPolicy.observe``): a round's
launch and reading, which the costs leave out, can cost a drafting round far
more than a plain one (on an H200 at 12B shapes a round's launch took about
5-13 ms beyond its verify forward's and its draft's), so drafts that pay on
the measured costs alone can be slower than plain decoding. The policy, with what
it learnt, is kept across the drafter's generations (one per thread), as its
acceptance is.

Lossless when sampling: a round's choice uses only earlier rounds, this
generation's and the drafter's earlier generations' (and the padding changes
no logit).
"""

import threading
from collections import deque

from ..batching.policy import Acceptance, BatchPolicy
from ..confidence.calibration import kept_rates
from ..confidence.costs import VERIFIES_MEASURED_PER_ROUND
from ..confidence.schedulers import CostScheduler

# Threads whose streams' policies a scheduler keeps (``_policy``).
THREADS_KEPT = 16


class Pacing:
    """One generation's pacing under the ``cost`` scheduler."""

    def __init__(self, scheduler, timer, drafts: int):
        self.scheduler, self.timer = scheduler, timer
        # The drafter's acceptance over its earlier generations (kept by its
        # scheduler) is where this generation's estimate starts.
        self.recent = scheduler.recent_acceptance.setdefault(drafts, Acceptance(drafts))
        self.acceptance = self.recent.newcomer()
        self.policy = _policy(scheduler.paced_policies, (drafts, getattr(timer, "key", None)))
        self._chosen = self.policy.restart()
        self.clock = scheduler.clock
        # When each round chosen and not yet read was (``None``: not to be
        # observed), when the last round's verdict was read, and the sum
        # and count of the times of a run of rounds read after their
        # successor was chosen.
        self._began = deque()
        self._read = None
        self._overlapped = (0.0, 0)
        # The policy's counts before and after each round chosen and not
        # yet read (``abandon``).
        self._counts = deque()

    def drafts(self, cap: int, depth: int) -> int:
        """A round's drafts; at a depth not measured yet, it measures the
        next few verify lengths (on this generation's caches) and drafts no
        further than they reach. The round's time starts once it is chosen
        (measuring left out), or where it is chosen before the round before
        it is read, at that read."""
        scheduler, timer = self.scheduler, self.timer
        self.policy.restart(self._chosen)
        before = _counts(self.policy)
        profile = scheduler.profile(timer)
        timings = getattr(profile, "timings", 0)
        try:
            # Only for this choice: the policy outlives the generation, and
            # the timer holds the generation's caches.
            self.policy.costs = lambda _, depth: scheduler.costs(
                depth, timer, most=VERIFIES_MEASURED_PER_ROUND
            )
            drafts = self.policy.choose([self.acceptance.round_rates(cap)], [cap], depth)
        finally:
            self.policy.costs = None
        self._counts.append((before, _counts(self.policy)))
        if self.clock is None:
            return drafts
        if getattr(profile, "timings", 0) != timings:
            # Costs were measured on the live caches, which waited for the
            # rounds in flight: their times are not their own.
            self._began = deque(None for _ in self._began)
            self._read = None
        self._began.append(self.clock())
        return drafts

    def verifies(self, drafts: int, depth: int, drawn: int) -> None:
        """The round verifies ``drafts`` of the ``drawn`` it drafted (its
        drafter's confidences chose fewer): its time is weighed against
        theirs."""
        known = self.scheduler.profile(self.timer).known(depth, self.timer)
        if known is not None:
            self.policy.restart(self._chosen)
            self.policy.verifies(drafts, known.padded(), drawn=drawn)

    def rows(self, tokens: int, depth: int) -> int:
        known = self.scheduler.profile(self.timer).known(depth, self.timer)
        return tokens if known is None else known.cheapest_rows(tokens)

    def measures(self, depth: int) -> bool:
        """Whether choosing a round at ``depth`` would time verifies first
        (its costs there are not all measured yet)."""
        return self.scheduler.profile(self.timer).measured(depth, self.timer) is None

    def update(self, verified: int, accepted: int) -> None:
        """The oldest round's verdict, read: its acceptance, and its time
        (a round chosen while the one before it ran, from that one's read:
        the device did the two in turn)."""
        if self._counts:
            self._counts.popleft()
        if self._began:
            began, read = self._began.popleft(), self.clock()
            seconds = None
            if began is not None:
                seconds = read - (began if self._read is None else max(began, self._read))
            self._read = read
            self.policy.restart(self._chosen)
            if seconds is not None and self._began:
                # Its successor was built while it ran, so the host's work
                # for one fell in the other's time: a run of such rounds is
                # observed at its mean so far.
                total, count = self._overlapped
                self._overlapped = (total + seconds, count + 1)
                seconds = self._overlapped[0] / self._overlapped[1]
            elif not self._began:
                self._overlapped = (0.0, 0)
            self.policy.observe(seconds)
        self.acceptance.update(verified, accepted)
        self.recent.update(verified, accepted)

    def abandon(self) -> None:
        """The generation ended with rounds chosen and never run (built
        ahead of a token that stopped it, or of a caller that stopped
        reading): the policy, which later generations keep, counts none of
        them. (Counting one, a probe never run made a parked stream's next
        generation skip its own first probe: ``BatchPolicy.probe_first``.)"""
        # Unless the thread's other generations chose rounds since.
        if self._counts and _counts(self.policy) == self._counts[-1][1]:
            policy = self.policy
            policy.parked, policy.drafting, policy.deepest = self._counts[0][0]
        self._counts.clear()

    def expect(self, first: int, logits) -> None:
        """The round's drafts from position ``first`` on, whose confidences
        were ``logits[first:]``, were drafted and not verified, and every
        verified one was accepted: they count at their calibrated
        confidences (``Acceptance.expect``)."""
        rates = kept_rates(logits, getattr(self.scheduler, "temperatures", None))[first:]
        self.acceptance.expect(first, rates)
        self.recent.expect(first, rates)


def _counts(policy: BatchPolicy) -> tuple:
    """What a round chosen counts in ``policy`` for those after it."""
    return policy.parked, policy.drafting, policy.deepest


def _policy(policies: dict, key: tuple) -> BatchPolicy:
    """The policy of this thread's streams with ``key`` (drafts a round,
    the timer's key): one a thread, as two streams advanced in turn on two
    threads would mix their rounds' shapes and counts. A thread new to it
    (a server's handler, a pool's worker) starts from what the thread that
    last paced one learnt; the ``THREADS_KEPT`` threads that paced last keep
    theirs."""
    own = (*key, threading.get_ident())
    policy = policies.pop(own, None)
    if policy is None:
        latest = [p for k, p in list(policies.items()) if k[:2] == key]
        policy = latest[-1].newcomer() if latest else BatchPolicy(probe_first=True)
    policies[own] = policy  # the most recent last
    while len(policies) > THREADS_KEPT:
        del policies[next(iter(policies))]
    return policy


class FixedPacing:
    """Every round proposes as many drafts as it may and verifies them."""

    def drafts(self, cap: int, depth: int) -> int:
        return cap

    def verifies(self, drafts: int, depth: int, drawn: int) -> None:
        pass

    def rows(self, tokens: int, depth: int) -> int:
        return tokens

    def measures(self, depth: int) -> bool:
        return False

    def update(self, verified: int, accepted: int) -> None:
        pass

    def abandon(self) -> None:
        pass

    def expect(self, first: int, logits) -> None:
        pass


def pacing_for(scheduler, timer, drafts: int):
    # Only the cost scheduler keeps what a pacing learns across generations
    # and pads verifies into rows the engine's caches were made for.
    if isinstance(scheduler, CostScheduler):
        return Pacing(scheduler, timer, drafts)
    return FixedPacing()
