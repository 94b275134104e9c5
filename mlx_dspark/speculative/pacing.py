"""How many drafts a single stream's round proposes, and how many rows it
verifies.

Under the ``cost`` scheduler a generation is a speculative batch of one: each
round proposes the number of drafts with the most expected tokens per second
from the recent acceptance by position and the measured round costs, and 0
(a plain decode step, the drafter idle) when speculating is slower; a parked
generation re-probes now and then (``batching.policy``). The verify then runs
at the cheapest row count at least as long as ``[anchor, drafts]``, padded
after the drafts: attention is causal, so the real rows' logits are the same,
and the padding's outputs are discarded and its cache entries rolled back.

Lossless when sampling: a round's choice uses only earlier rounds, this
generation's and the drafter's earlier generations' (and the padding changes
no logit).
"""

from ..batching.policy import Acceptance, BatchPolicy


class Pacing:
    """One generation's pacing under the ``cost`` scheduler."""

    def __init__(self, scheduler, timer, drafts: int):
        self.scheduler, self.timer = scheduler, timer
        # The drafter's acceptance over its earlier generations (kept by its
        # scheduler) is where this generation's estimate starts.
        self.recent = scheduler.recent_acceptance.setdefault(drafts, Acceptance(drafts))
        self.acceptance = self.recent.newcomer()
        self.policy = BatchPolicy(lambda _, depth: scheduler.costs(depth, timer))

    def drafts(self, cap: int, depth: int) -> int:
        return self.policy.choose([self.acceptance.rates()], [cap], depth)

    def rows(self, tokens: int, depth: int) -> int:
        costs = self.scheduler.profile(self.timer).costs(depth, self.timer)
        return costs.cheapest_rows(tokens)

    def update(self, verified: int, accepted: int) -> None:
        self.acceptance.update(verified, accepted)
        self.recent.update(verified, accepted)


class FixedPacing:
    """Every round proposes as many drafts as it may and verifies them."""

    def drafts(self, cap: int, depth: int) -> int:
        return cap

    def rows(self, tokens: int, depth: int) -> int:
        return tokens

    def update(self, verified: int, accepted: int) -> None:
        pass


def pacing_for(scheduler, timer, drafts: int):
    if callable(getattr(scheduler, "costs", None)):
        return Pacing(scheduler, timer, drafts)
    return FixedPacing()
