"""A single stream's ``cost`` pacing replayed on a machine's measured costs,
without the machine: what parking, probing and the number of drafts cost
or gain against plain decoding and against drafting every round.

The pacing is the engine's own (``speculative.pacing.Pacing``, its policy
and acceptance kept across generations as a drafter's scheduler keeps them),
on a clock that moves by each round's simulated time: a plain round takes
``--plain-ms``, a drafting round its padded verify and draft from the costs
plus ``--drafting-extra-ms`` (the host's work and launch, which the measured
costs leave out), the first drafting round after plain ones
``--after-parked-ms`` more and the first plain round after drafting ones
``--after-drafting-ms`` more (changes of shape). Each time is drawn with a
relative spread of ``--spread``. Acceptance is replayed as in the paired
benchmark (each draft kept with the chance that gives tau) by generation:
``--taus 2 6`` alternates a tau-2 and a tau-6 generation. One warm-up
generation runs first, uncounted (``--fresh``: counted, as a fresh
process's first generation is all ``mlx_lm.generate`` runs). Each
generation starts from its drafter's recent acceptance, as a server's
requests do in the batch generator, whose counts (``Acceptance``) are the
same; its policy is not (a server's does not probe at once where it never
drafted so deep, and chooses a round before the one before it is read).
``--decay`` sets how fast the counts forget.

    python pacing_sim.py --profile results/h200-verify-cost-profiles-s34/5fef59d35f143e491920.json \\
        --plain-ms 10.15 --drafting-extra-ms 3.6 --taus 3.3

This is a model of a machine, not a measurement: it says which way a change
to the policy moves a row, on costs a device measured, and by about how
much; the device says by how much.
"""

import argparse
import json
import random
import statistics
from pathlib import Path
from types import SimpleNamespace

from mlx_dspark.batching.policy import DECAY, Acceptance
from mlx_dspark.confidence.costs import RoundCosts
from mlx_dspark.confidence.schedulers import CostScheduler
from mlx_dspark.doctor import conditional_for_tau
from mlx_dspark.speculative.pacing import Pacing

from paired import set_probe_share


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def table_scheduler(costs: RoundCosts, clock) -> CostScheduler:
    """The cost scheduler on ``costs`` at every depth, timing rounds on ``clock``."""
    scheduler = CostScheduler(None, cache_profiles=False, clock=clock)
    table = SimpleNamespace(
        costs=lambda depth, timer, most=None: costs,
        known=lambda depth, timer: costs,
        measured=lambda depth, timer: costs,
    )
    scheduler.profile = lambda timer: table
    return scheduler


def load_costs(path: Path, depth: int) -> RoundCosts:
    """The costs a verify-cost profile measured at ``depth``'s bucket (the
    deepest bucket measured in full, where ``depth`` is not given)."""
    entries = json.loads(path.read_text())
    full = {int(k): v for k, v in entries.items() if "next_length" not in v}  # not under way
    entry = entries[str(depth)] if depth else full[max(full)]
    return RoundCosts(entry["draft"], entry["verify"], entry.get("draft_one"), entry.get("drafts") or 1)


def simulate(
    costs, drafts, taus, plain, extra, after_parked, spread, generations, tokens, seed,
    decay=DECAY, fresh=False, after_drafting=0.0,
):
    """(plain decoding's time over the paced stream's, and over drafting
    every round's as ``fixed`` does, unpadded; the share of rounds that
    drafted) over ``generations`` of ``tokens`` tokens each, after one
    uncounted unless ``fresh``."""
    draws = random.Random(seed)
    clock = Clock()
    scheduler = table_scheduler(costs, clock)
    scheduler.recent_acceptance[drafts] = Acceptance(drafts, decay=decay)
    padded = costs.padded()

    def seconds(mean):
        return mean * max(0.0, draws.gauss(1.0, spread))

    paced = fixed = plain_time = 0.0
    rounds = drafted = 0
    for g in range(generations if fresh else generations + 1):
        counted = fresh or g > 0
        kept = conditional_for_tau(taus[g % len(taus)], drafts)
        pacing = Pacing(scheduler, None, drafts)
        spent = made = 0
        was_drafting = None  # a generation's first round changes no shape
        while made < tokens:
            k = pacing.drafts(drafts, 2048)
            accepted = 0
            while accepted < k and draws.random() < kept:
                accepted += 1
            if k:
                pacing.verifies(k, 2048, k)
                took = seconds(padded.verify[k] + padded.drafting(k) + extra)
                took += after_parked if was_drafting is False else 0.0
            else:
                took = seconds(plain) + (after_drafting if was_drafting else 0.0)
            clock.now += took
            pacing.update(k, accepted)
            was_drafting = k > 0
            if counted:
                spent += took
                rounds += 1
                drafted += k > 0
            made += 1 + accepted
        if counted:
            paced += spent
            plain_time += made * plain
            # Drafting every round at this acceptance, as ``fixed`` does
            # (which verifies the round's own rows, unpadded).
            every = costs.verify[drafts] + costs.drafting(drafts) + extra
            fixed += made / tau_of(kept, drafts) * every
    return plain_time / paced, plain_time / fixed, drafted / rounds


def tau_of(kept: float, drafts: int) -> float:
    """Tokens a round of ``drafts`` drafts emits, each kept at ``kept``."""
    return sum(kept**i for i in range(drafts + 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True, help="a verify-cost profile (JSON)")
    parser.add_argument("--depth", type=int, help="its depth bucket (default: the deepest measured in full)")
    parser.add_argument("--drafts", type=int, help="drafts a round (default: the profile's)")
    parser.add_argument("--plain-ms", type=float, required=True, help="a plain step, pipelined")
    parser.add_argument("--drafting-extra-ms", type=float, default=0.0)
    parser.add_argument("--after-parked-ms", type=float, default=0.0)
    parser.add_argument("--after-drafting-ms", type=float, default=0.0)
    parser.add_argument("--spread", type=float, default=0.05)
    parser.add_argument("--taus", type=float, nargs="+", default=[3.3])
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--decay", type=float, default=DECAY, help="of the acceptance counts, a round")
    parser.add_argument("--fresh", action="store_true", help="count the first generation too")
    parser.add_argument("--probe-share", type=float, help="as paired.py's (default: the policy's own)")
    args = parser.parse_args(argv)
    if args.probe_share is not None:
        if args.probe_share <= 0:
            parser.error("--probe-share: a share of the parked time, above 0")
        set_probe_share(args.probe_share)
    if not 0 < args.decay <= 1:
        parser.error("--decay: what a round's counts keep of the round before's, in (0, 1]")
    costs = load_costs(args.profile, args.depth)
    drafts = args.drafts or costs.drafts
    if not drafts:
        parser.error("the profile names no drafts a round: give --drafts")
    runs = [
        simulate(
            costs, drafts, args.taus, args.plain_ms / 1000, args.drafting_extra_ms / 1000,
            args.after_parked_ms / 1000, args.spread, args.generations, args.tokens, seed,
            args.decay, args.fresh, args.after_drafting_ms / 1000,
        )
        for seed in range(args.seeds)
    ]
    paced, fixed, share = zip(*runs)
    report = {
        "taus": args.taus,
        "drafts": drafts,
        "paced_vs_plain": round(statistics.mean(paced), 3),
        "paced_vs_plain_range": [round(min(paced), 3), round(max(paced), 3)],
        "fixed_vs_plain": round(statistics.mean(fixed), 3),
        "drafted_share": round(statistics.mean(share), 3),
        "runs_under_plain": sum(p < 1 for p in paced),
        "simulated": True,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
