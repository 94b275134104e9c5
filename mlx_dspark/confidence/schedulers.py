"""How many of a round's drafts to verify.

- ``fixed``: all of them (DeepSpec's default, the paper's Table 1 setting);
- ``threshold``: up to the first draft whose confidence ``σ(z_k)`` is below
  a threshold (DeepSpec's ``--confidence-threshold``);
- ``cost``: the paper's hardware-aware prefix scheduler (Algorithm 1), which
  maximises expected tokens per second against the measured cost of a round on
  this machine, with the calibrated confidences. For every drafter, with a
  confidence head or without, the engine then also verifies at the cheapest
  row count, chooses each round's drafts from the recent acceptance by
  position and parks speculation when it does not pay (``speculative.pacing``).

Every rule is lossless: verifying any prefix of the drafts is. Under sampling
a rule must also be *causal* (paper Appendix A): whether draft k is verified
may depend on the confidences up to ``z_k`` (which sees drafts before k) but
not on anything computed from draft k or later. Both confidence rules decide
position by position and stop at the first refusal.
"""

import copy
import os
import time
import warnings
import weakref
from typing import Callable, List, Optional, Sequence

from .calibration import CACHE_SETTINGS, Calibration, sigmoid, survival
from .costs import CostProfile, RoundCosts, RoundTimer, profile_path


def prefix_schedule(
    survival_by_request: Sequence[Sequence[float]],
    steps_per_second: Callable[[int], float],
) -> List[int]:
    """Algorithm 1 of the paper: drafts to verify per request.

    ``survival_by_request[r][j - 1]`` is ``a_{r,j}``, the predicted chance
    that request r's drafts ``1..j`` all survive (non-increasing in j).
    ``steps_per_second(n)`` is the target's verify rate for ``n`` tokens in
    all. Every request verifies its anchor; drafts are admitted in order of
    ``a`` (a request's own in position order) while the expected throughput
    ``(R + Σ a) * steps_per_second(R + admitted)`` strictly improves, or
    would with the request's later drafts (``survival_ahead``), and the
    search stops at the first draft that would not (the causal early stop).
    The lookahead crosses a verify's cost cliff: where 2-7 rows cost far
    more than 1 and 8 half of 7 (a 4-bit 12B target on an H200), the first
    draft alone never pays and seven do. It looks along the request of the
    draft weighed only; with several requests, one request's refusal still
    ends the search for all (the engine schedules one request a round).
    ``steps_per_second`` must cover every request's drafts at once.
    """
    for row in survival_by_request:
        if any(later > earlier for earlier, later in zip(row, row[1:])):
            raise ValueError(
                f"Prefix survival must not increase with position, got {list(row)}."
            )
    requests = len(survival_by_request)
    lengths = [0] * requests
    tokens, expected = requests, float(requests)
    current = expected * steps_per_second(tokens)
    candidates = sorted(
        (
            (a, j, r)
            for r, row in enumerate(survival_by_request)
            for j, a in enumerate(row, start=1)
            if a > 0
        ),
        key=lambda c: (-c[0], c[1], c[2]),
    )
    for a, j, r in candidates:
        row = survival_by_request[r]
        ahead = survival_ahead(row, j, len(row))
        reachable = max(
            (expected + sum(ahead[:m])) * steps_per_second(tokens + m)
            for m in range(1, len(ahead) + 1)
        )
        if reachable <= current:
            break
        lengths[r] = j
        tokens += 1
        expected += a
        current = expected * steps_per_second(tokens)
    return lengths


def survival_ahead(row: Sequence[float], j: int, length: int) -> List[float]:
    """The predicted survival of drafts ``j..length`` as known at draft
    ``j``: its own (``row[j - 1]``), then each later draft kept at draft
    ``j``'s conditional rate. It reads nothing past ``j`` (Appendix A)."""
    survival = row[j - 1]
    before = row[j - 2] if j > 1 else 1.0
    rate = min(1.0, survival / before) if before > 0 else 0.0
    return [survival * rate**i for i in range(length - j + 1)]


class FixedScheduler:
    """Verify every draft."""

    name = "fixed"
    needs_confidence = False

    def choose(self, logits: List[float], depth: int, timer: RoundTimer) -> int:
        return len(logits)


class ThresholdScheduler:
    """Verify up to the first draft with ``σ(z_k) < threshold`` (the raw
    confidence, as DeepSpec applies it)."""

    name = "threshold"
    needs_confidence = True

    def __init__(self, threshold: float):
        self.threshold = threshold

    def choose(self, logits: List[float], depth: int, timer: RoundTimer) -> int:
        for k, confident in enumerate(sigmoid(logits) >= self.threshold):
            if not confident:
                return k
        return len(logits)


class CostScheduler:
    """Algorithm 1 for one request, with the round's measured costs: the
    verify of ``1 + ℓ`` tokens (padded, ``RoundCosts.cheapest_rows``) plus the draft, at
    the current depth. Without ``temperatures`` (a drafter without a
    confidence head) every draft the engine's pacing asks for is verified.
    Without ``paces_sampling`` a sampled generation runs ``fixed`` instead:
    a paced one draws its random numbers where its rounds fall, which
    follow this machine's timings and the drafter's earlier generations, so
    one seed would give another text each time (greedy output is the
    target's whatever the rounds)."""

    name = "cost"

    def __init__(
        self,
        temperatures: Optional[Sequence[float]],
        cache_profiles: bool = True,
        clock: Optional[Callable[[], float]] = time.perf_counter,
        paces_sampling: bool = True,
    ):
        self.paces_sampling = paces_sampling
        self.temperatures = None if temperatures is None else list(temperatures)
        self.needs_confidence = temperatures is not None
        self.cache_profiles = cache_profiles
        self.profiles = {}
        self._keys = {}  # (timer key, cache settings) -> key in ``profiles``
        # Drafts per round -> the drafter's recent acceptance by position
        # over the generations it paced (``speculative.pacing``); (drafts
        # per round, timer key, thread) -> the policy that paced them, with
        # the rounds' realised times it learnt on ``clock`` (``None``: rounds
        # not timed), for the threads that paced last (``pacing._policy``).
        self.recent_acceptance = {}
        self.paced_policies = {}
        self.clock = clock

    def pacing_sampling(self) -> "CostScheduler":
        """This scheduler, pacing sampled generations too, with what this
        one measured and learnt, and learns on for both."""
        twin = copy.copy(self)
        twin.paces_sampling = True
        return twin

    def profile(self, timer: RoundTimer) -> CostProfile:
        # By file, not by key alone: a scheduler lives as long as its drafter,
        # and the cache folder (``MLX_DSPARK_CACHE``) may change meanwhile.
        # Rounds look it up several times each, and working out the folder
        # took a parked round's pacing half its time: once per setting.
        where = (timer.key, *(os.environ.get(name) for name in CACHE_SETTINGS))
        key = self._keys.get(where)
        if key is None:
            path = profile_path(timer.key) if self.cache_profiles else None
            key = self._keys[where] = path or timer.key
        if key not in self.profiles:
            self.profiles[key] = CostProfile(key if self.cache_profiles else None)
        return self.profiles[key]

    def costs(self, depth: int, timer: RoundTimer, most: Optional[int] = None) -> RoundCosts:
        """The measured costs at ``depth``, every verify padded as
        ``RoundCosts.cheapest_rows`` pads it; ``most``: measure no more than that many verify
        lengths now (``CostProfile.costs``)."""
        return self.profile(timer).costs(depth, timer, most=most).padded()

    def choose(self, logits: List[float], depth: int, timer: RoundTimer) -> int:
        # The round's pacing has measured what it needs at this depth.
        known = self.profile(timer).known(depth, timer)
        costs = self.costs(depth, timer) if known is None else known.padded()
        # No further than the verify lengths measured (a measurement under
        # way may not have reached them all).
        logits = logits[: len(costs.verify) - 1]
        [length] = prefix_schedule(
            [survival(logits, self.temperatures)], costs.rounds_per_second
        )
        return length


SCHEDULERS = ("fixed", "threshold", "cost")


def make_scheduler(
    name: Optional[str],
    threshold: float,
    calibration: Optional[Calibration],
    block_size: int,
    has_confidence: bool,
    where: str,
):
    """The scheduler a drafter is loaded with. ``None``: ``threshold`` when a
    threshold is given, else ``cost`` for greedy decoding, which reads the
    drafter's confidences only where they are calibrated, and ``fixed`` when
    sampling (``CostScheduler.paces_sampling``). (``fixed`` was the default
    for both: on an H200 a 4-bit 12B target with the Gemma-4 assistant at
    chat acceptance ran at 0.67x of plain decoding under it, 1.29x under
    ``cost``.)"""
    if name is None and threshold <= 0:
        temperatures = calibration.temperatures if calibration and has_confidence else None
        return CostScheduler(temperatures, paces_sampling=False)
    if name is None:
        name = "threshold"
    if name not in SCHEDULERS:
        raise ValueError(
            f"scheduler must be one of {', '.join(SCHEDULERS)}, got {name!r}."
        )
    if name == "threshold" and not has_confidence:
        raise ValueError(
            f"{where} has no confidence head (a DFlash drafter, or a Gemma-4 assistant), so it cannot use "
            "the threshold scheduler; use fixed or cost (and confidence_threshold 0)."
        )
    if name == "threshold" and threshold <= 0:
        raise ValueError(
            "The threshold scheduler needs confidence_threshold "
            "(--draft-confidence-threshold) in (0, 1]."
        )
    if name != "threshold" and threshold > 0:
        raise ValueError(
            "confidence_threshold (--draft-confidence-threshold) applies to the "
            f"threshold scheduler, not {name}."
        )
    if name == "fixed":
        return FixedScheduler()
    if name == "threshold":
        return ThresholdScheduler(threshold)
    if not has_confidence:
        return CostScheduler(None)
    if calibration is None:
        warnings.warn(
            f"The cost scheduler is using {where}'s uncalibrated confidences; "
            "calibrate them with `mlx_dspark calibrate` for better schedules.",
            stacklevel=2,
        )
        return CostScheduler([1.0] * block_size)
    return CostScheduler(calibration.temperatures)


# Schedulers made by name for a drafter loaded with another one, kept for
# its later generations as its own would be: ``cost`` learns the drafter's
# acceptance and the machine's costs as it goes.
_named = weakref.WeakKeyDictionary()


def scheduler_for(choice, drafter):
    """The scheduler for one generation: ``None`` (the drafter's own, or
    the default of ``make_scheduler``), a name (the same object each
    generation of this drafter), or a scheduler object."""
    own = getattr(drafter, "scheduler", None)
    if choice is None and own is not None:
        return own
    if choice is not None and not isinstance(choice, str):
        return choice
    if choice == "threshold" and not isinstance(own, ThresholdScheduler):
        raise ValueError(
            "The threshold scheduler takes its threshold from the drafter: load "
            "it with confidence_threshold (--draft-confidence-threshold)."
        )
    if own is not None and own.name == choice and getattr(own, "paces_sampling", True):
        return own
    try:
        named = _named.setdefault(drafter, {})
    except TypeError:  # a drafter that cannot be weakly referenced
        named = {}
    if choice not in named and choice == "cost" and isinstance(own, CostScheduler):
        # The default ``cost``, which leaves sampled generations to ``fixed``.
        named[choice] = own.pacing_sampling()
    if choice not in named:
        model = getattr(drafter, "model", None)
        named[choice] = make_scheduler(
            choice,
            0.0,
            getattr(drafter, "calibration", None),
            drafter.block_size,
            getattr(model, "confidence_head", None) is not None,
            getattr(drafter, "path", "this drafter"),
        )
    return named[choice]
