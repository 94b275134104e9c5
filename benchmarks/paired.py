"""Speculative vs plain decoding at Gemma-4-12B shapes, measured in pairs.

On a machine whose speed drifts between runs (a shared GPU host), ratios of
separate runs mislead. Here each plain run is followed at once by a
speculative run on the same model and prompt, and the report gives the median
(and range) of the per-pair ratios, next to ``bound_speedup = max(1, tau *
T_decode / (T_verify + T_draft))``, each pair's own: its components are timed
just before its plain run, the verify at the row count the engine pads to
(``speculative.components``), and tau is its drafting rounds' (``bounds``,
``drafted_tau``).

Acceptance is replayed (see ``speculative.replayed_acceptance``): wall-clock
is real, acceptance follows the paper's profiles (Table 1 Gemma-4-12B DSpark:
tau ~ 6 on math, ~ 3.3 on chat). Each row also has the round's phase
timings (``speculative.phases``: host graph building, drafting, verifying,
the verdict and the bookkeeping). Writes JSON lines to ``--out`` and stdout.

``--fresh``: each speculative run starts as a fresh process's only
generation does (``mlx_lm.generate``): its drafter's scheduler has learnt
no acceptance and no policy, only the costs (which a fresh process reads
from disk).

On MLX-CUDA the engine verifies a 4-bit target's 2-8 rows by its multirow
kernel (``mlx_dspark.targets.multirow``), and the rows say so
(``multirow``: the modules routed); ``MLX_DSPARK_MULTIROW=0`` runs them on
MLX's own kernels.

MLX runs with the launch settings ``mlx_lm.generate`` and ``mlx_lm.server``
set with a drafter (on MLX-CUDA, CUDA graphs off for an unquantized target),
plain decoding included, unless ``--mlx-launch-settings``. MLX reads them
once a process, so a process runs one target precision then.
"""

import argparse
import collections
import itertools
import json
import math
import os
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark.batching import policy
from mlx_dspark.confidence.costs import LAUNCH_SETTINGS, launch_settings_for_speculation
from mlx_dspark.confidence.schedulers import scheduler_for
from mlx_dspark.progress import progress
from mlx_dspark.targets import multirow
import shapes
from speculative import components, phases, replayed_acceptance
from timing import backend

DRAFTERS = {
    "dspark": dict(variant="dspark"),
    "dspark 8-bit": dict(variant="dspark", bits=8),
    "dspark 4-bit": dict(variant="dspark", bits=4),
    "dflash": dict(variant="dflash"),
    "assistant": None,
}


def throughput(steps, history=None) -> tuple:
    """Tokens per second after the first token, the tokens, and when each
    was yielded; given a speculative run's ``stats.history``, also when each
    of its rounds yielded its first token (the rounds appended meanwhile)."""
    tokens, stamps, rounds = [], [], []
    start = None if history is None else len(history)
    for step in steps():
        stamps.append(time.perf_counter())
        tokens.append(int(step[0]))
        if history is not None and start + len(rounds) < len(history):
            rounds.append(stamps[-1])
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), tokens, stamps, rounds


def bounds(pairs) -> dict:
    """The bound and the speedup's share of it, per pair from the pair's own
    plain throughput, component timings and tau: on an H100 that changed
    speed mode from run to run, components timed once at a drafter's start
    and plain runs timed later gave quotients of 0.82-1.20 for rounds alike.
    ``pairs``: ``(plain_tps, spec_tps, t_verify, t_draft, tau)`` per pair.
    Never under 1: where drafting every round is slower, plain decoding (a
    parked round) is the best a round can do."""
    bound = [max(1.0, tau / plain / (verify + draft)) for plain, _, verify, draft, tau in pairs]
    share = sorted(spec / plain / b for (plain, spec, *_), b in zip(pairs, bound))
    return {
        "bound_speedup": round(statistics.median(bound), 3),
        "speedup_over_bound": round(statistics.median(share), 3),
        "speedup_over_bound_range": [round(share[0], 3), round(share[-1], 3)],
        "t_verify_ms": round(1000 * statistics.median(p[2] for p in pairs), 2),
        "t_draft_ms": round(1000 * statistics.median(p[3] for p in pairs), 2),
    }


def drafted_tau(rounds, replayed: float) -> float:
    """A pair's tokens per drafting round, for its bound: over its rounds
    that drafted where they are at least half of them, else the ``replayed``
    tau (a parked pair's few probes say little, and its parked rounds'
    one token each would put the bound under plain decoding)."""
    drafted = [r.acceptance_length for r in rounds if r.drafts]
    return statistics.mean(drafted) if 2 * len(drafted) >= len(rounds) > 0 else replayed


def forget_pacing(drafter, scheduler) -> None:
    """``drafter``'s ``scheduler`` (a name or an object) as a fresh process
    has it: the acceptance and policies its generations learnt forgotten,
    its measured costs kept."""
    scheduler = scheduler_for(scheduler, drafter)
    for learnt in ("recent_acceptance", "paced_policies"):
        getattr(scheduler, learnt, {}).clear()


POLICY_PROBES = (policy.PROBE_SHARE, policy.REPROBE_AT_MOST)


def set_probe_share(share: float) -> None:
    """A parked stream's probes may lose ``share`` of its time instead of
    the policy's ``PROBE_SHARE``, their longest interval growing with it so
    that the share, not the cap, binds where it did (a power of two times
    ``REPROBE_EVERY``): one share against another on a device, without
    rebuilding the package it installs."""
    default_share, default_most = POLICY_PROBES
    ratio = default_most * default_share / (policy.REPROBE_EVERY * share)
    policy.REPROBE_AT_MOST = policy.REPROBE_EVERY * 2 ** max(0, math.ceil(math.log2(ratio)))
    policy.PROBE_SHARE = share


ROUND_KINDS = ("parked", "parked after drafting", "drafting after parked", "drafting")
SLOWEST = 8


def round_kind(round, before) -> str:
    """A round's kind by whether it and the one before it drafted (a
    generation's first round comes after the prompt's forward, a plain one)."""
    drafted = bool(round.drafts)
    was = before is not None and bool(before.drafts)
    if drafted:
        return "drafting" if was else "drafting after parked"
    return "parked after drafting" if was else "parked"


def rounds_lost(generations, plain_token: float) -> dict:
    """Where the speculative runs' time went against plain decoding's, by
    kind of round: each round's seconds (from the first token of the round
    before it to its own first token; a generation's first round from its
    first token, which the prompt's forward gave) less what plain decoding
    takes for its tokens (``plain_token`` seconds each). ``lost_share``: a
    kind's loss in the runs' total time (negative: it gained); ``slowest``:
    the ``SLOWEST`` longest rounds, by generation and index in it."""
    by_kind = collections.defaultdict(list)
    total, every = 0.0, []
    for g, (rounds, first, stamps) in enumerate(generations):
        times = [b - a for a, b in zip([first] + stamps, stamps)]
        total += stamps[-1] - first if stamps else 0.0
        for i, (r, seconds) in enumerate(zip(rounds, times)):
            kind = round_kind(r, rounds[i - 1] if i else None)
            by_kind[kind].append((seconds, r.acceptance_length))
            every.append((seconds, g, i, kind))
    lost = {
        kind: {
            "rounds": len(by_kind[kind]),
            "median_ms": round(1000 * statistics.median(s for s, _ in by_kind[kind]), 2),
            "lost_share": round(sum(s - n * plain_token for s, n in by_kind[kind]) / total, 4),
        }
        for kind in ROUND_KINDS
        if by_kind[kind]
    }
    lost["slowest"] = [
        {"generation": g, "round": i, "kind": kind, "ms": round(1000 * seconds, 2)}
        for seconds, g, i, kind in sorted(every, reverse=True)[:SLOWEST]
    ]
    return lost


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--taus", type=float, nargs="+", default=[3.3, 6.0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--target-bits", type=int, nargs="+", default=[16])
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS))
    parser.add_argument("--schedulers", nargs="+", default=["fixed"], choices=["fixed", "cost"])
    parser.add_argument("--out", default="paired.jsonl")
    parser.add_argument(
        "--probe-share", type=float,
        help="the share of a parked stream's time its probes may lose (default: the policy's own)",
    )
    parser.add_argument(
        "--fresh", action="store_true",
        help="each speculative run paced as a fresh process's first generation",
    )
    parser.add_argument(
        "--mlx-launch-settings", action="store_true",
        help="keep MLX's own launch settings, not those the commands set with a drafter",
    )
    args = parser.parse_args()
    if len(args.target_bits) > 1 and not args.mlx_launch_settings:
        parser.error(
            "MLX reads its launch settings once a process, and the commands' depend on "
            "the target's precision: one --target-bits a process, or --mlx-launch-settings"
        )

    if args.probe_share is not None:
        if args.probe_share <= 0:
            parser.error("--probe-share: a share of the parked time, above 0")
        set_probe_share(args.probe_share)
    # Before anything is evaluated on the device (a module's weights take
    # their random keys when it is built).
    mx.random.seed(0)
    model = shapes.target_module(args.scale)
    if args.target_bits == [16] and not args.mlx_launch_settings:
        launch_settings_for_speculation(model)
    launch = {name: os.environ[name] for name in LAUNCH_SETTINGS if name in os.environ}
    drafters = {
        name: shapes.make_assistant(args.scale)
        if DRAFTERS[name] is None
        else shapes.make_drafter(args.scale, **DRAFTERS[name])
        for name in args.drafters
    }
    model = shapes.finish(model)
    prompt = mx.random.randint(5, model.args.vocab_size, (args.context,))
    prompt = prompt.astype(mx.uint32)

    def plain():
        return generate_step(prompt, model, max_tokens=args.max_tokens)

    for bits in args.target_bits:
        if bits != 16:
            shapes.quantize(model, bits)
        for name, drafter in drafters.items():
            for tau, scheduler in itertools.product(args.taus, args.schedulers):
                stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)

                def speculative():
                    if args.fresh:
                        forget_pacing(drafter, scheduler)
                    return mlx_dspark.speculative_generate_step(
                        prompt, model, drafter, max_tokens=args.max_tokens, stats=stats, scheduler=scheduler
                    )

                with replayed_acceptance(tau, drafter.block_size):
                    throughput(speculative)  # warm-up
                    stats.history.clear()
                    runs, plain_tokens, generations = [], [], []
                    for _ in progress(range(args.pairs), desc=f"{name} tau {tau}"):
                        t_verify, t_draft = components(model, drafter, prompt, drafter.block_size)
                        plain_tps, _, stamps, _ = throughput(plain)
                        plain_tokens += [b - a for a, b in zip(stamps, stamps[1:])]
                        first = len(stats.history)
                        spec_tps, _, stamps, rounds = throughput(speculative, stats.history)
                        generations.append((stats.history[first:], stamps[0], rounds))
                        tau_pair = drafted_tau(stats.history[first:], tau)
                        runs.append((plain_tps, spec_tps, t_verify, t_draft, tau_pair))
                    phase_ms = phases(
                        model, drafter, prompt, args.max_tokens, drafter.block_size, scheduler
                    )
                ratios = sorted(s / p for p, s, *_ in runs)
                # How much plain decoding moves between consecutive pairs:
                # the noise a speedup near 1.0 must be read against.
                plain_noise = sorted(b[0] / a[0] for a, b in zip(runs, runs[1:])) or [1.0]
                plain_tps = statistics.median(p for p, *_ in runs)
                speedup = statistics.median(ratios)
                record = {
                    "target_bits": bits,
                    "drafter": name,
                    "scheduler": scheduler,
                    "replayed_tau": tau,
                    "tau": round(stats.tau, 3),
                    "plain_tok_s": round(plain_tps, 2),
                    "spec_tok_s": round(statistics.median(s for _, s, *_ in runs), 2),
                    "speedup": round(speedup, 3),
                    "speedup_range": [round(ratios[0], 3), round(ratios[-1], 3)],
                    "plain_vs_plain_range": [round(plain_noise[0], 3), round(plain_noise[-1], 3)],
                    **bounds(runs),
                    "round_phase_ms": phase_ms,
                    # What the scheduler verified: rounds by drafts verified
                    # (0: a plain decode step, parked).
                    "rounds_by_verified": dict(
                        sorted(collections.Counter(r.proposed for r in stats.history).items())
                    ),
                    # Which rounds drafted, in order, over the pairs'
                    # generations (where a paced stream probes, or flips).
                    "drafted_rounds": [i for i, r in enumerate(stats.history) if r.proposed],
                    # Each kind of round's time against plain decoding's
                    # for its tokens (``rounds_lost``).
                    "plain_token_ms": round(1000 * statistics.median(plain_tokens), 2),
                    "rounds_lost": rounds_lost(generations, statistics.median(plain_tokens)),
                    "context": args.context,
                    "max_tokens": args.max_tokens,
                    "acceptance": "replayed (synthetic); wall-clock real",
                    "backend": backend(),
                    "mlx": mx.__version__,
                    "launch_settings": launch,
                    "shapes": f"gemma-4-12b/{args.scale}",
                }
                if args.fresh:
                    record["fresh"] = True
                routed = multirow.routed_count(model)
                if routed:
                    record["multirow"] = routed
                if args.probe_share is not None:
                    record["probe_share"] = policy.PROBE_SHARE
                    record["reprobe_at_most"] = policy.REPROBE_AT_MOST
                line = json.dumps(record)
                print(line, flush=True)
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
