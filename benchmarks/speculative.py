"""Speculative vs plain decoding, in the same run on the same machine.

Two setups:

* the tiny pair bundled with the project (default; ``--quick`` for a short
  run): real acceptance;
* ``--shapes 12b`` (or ``--scale N`` for Gemma-4-12B shapes divided by N):
  random weights at real shapes, with **replayed acceptance**: target and
  drafter compute every round in full, but the number of accepted drafts is
  drawn from a profile with the given tau instead of compared (random weights
  accept almost nothing). Wall-clock is real; acceptance is synthetic, the
  output is not the target's, and the report says so.

Reports one JSON object (``--json``) or a table: plain and speculative
generation throughput (prompt processing excluded), their ratio, and
``bound_speedup = tau * T_decode / (T_verify(k+1) + T_draft)`` from the same
run's component timings: the speedup a round with no overhead beyond one
verify forward and one draft would reach.
"""

import argparse
import contextlib
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.confidence.costs import RoundCosts, verify_rows
from mlx_dspark.doctor import conditional_for_tau
from mlx_dspark.drafters.base import Proposal
from mlx_dspark.progress import progress
from mlx_dspark.speculative import decoding, engine
from mlx_dspark.speculative.engine import adapt_target

import shapes
from timing import backend, seconds

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"


@contextlib.contextmanager
def replayed_acceptance(tau: float, block_size: int, seed: int = 0):
    """Within the block, every greedy round accepts a number of drafts drawn
    from the profile "each draft accepted with probability c after an accepted
    one" whose mean accepted length is ``tau``. The real comparison stays in
    the graph, so the round's compute is unchanged.

    In the speculative batch generator (``mlx_lm.server`` with a drafter) a
    greedy row draws from its request's prompt and its context length: the
    same request at the same point accepts the same in every server and
    process, so policies and servers compared in one run see the same
    acceptance, not each its own luck (at one 96-token request a wave, a
    request's tau ranged 2.2-3.9).

    A drafter's confidences are replayed too: every draft's is the logit of
    the profile's rate ``c``, so a schedule that reads them (the ``cost``
    scheduler) sees confidences calibrated to the acceptance replayed that
    tell no round from another, not those of random weights, which have
    nothing to do with it. That holds for an uncalibrated drafter (the
    random-weight ones): a calibration's temperatures would scale them. Rows
    that sample keep their own acceptance, and get these confidences too."""
    conditional = conditional_for_tau(tau, block_size)
    rate = min(max(conditional, 1e-6), 1 - 1e-6)
    confident = math.log(rate / (1 - rate))
    draw = random.Random(seed)
    compare = decoding.greedy_accept
    judge = SpeculativeBatchGenerator._judge

    def one(drafts: int, rng=draw) -> int:
        accepted = 0
        while accepted < drafts and rng.random() < conditional:
            accepted += 1
        return accepted

    def replayed(drafts, target_tokens):
        # One row, or a batch of rows.
        rows = drafts.shape[0] if drafts.ndim == 2 else None
        drawn = one(drafts.shape[-1]) if rows is None else [one(drafts.shape[-1]) for _ in range(rows)]
        return 0 * compare(drafts, target_tokens) + mx.array(drawn)

    def keyed(generator, sequences, proposal, logits, drafts_per_row, contexts):
        log_probs, accepted, tokens = judge(generator, sequences, proposal, logits, drafts_per_row, contexts)
        drawn = [
            one(n, random.Random(hash((seed, tuple(s.tokens[:64]), len(s.tokens)))))
            if s.decoding.plain_greedy else None
            for s, n in zip(sequences, drafts_per_row)
        ]
        if all(d is None for d in drawn):
            return log_probs, accepted, tokens
        keep = mx.array([d is None for d in drawn])
        replay = mx.array([d or 0 for d in drawn], accepted.dtype)
        return log_probs, mx.where(keep, accepted, replay), tokens

    def replayed_confidence(proposal, *args, **kwargs):
        propose(proposal, *args, **kwargs)
        if proposal.confidence is not None:
            # Still computed, as the drafter's own are (and never NaN).
            own = proposal.confidence
            proposal.confidence = mx.where(mx.isfinite(own), 0 * own, 0) + confident

    propose = Proposal.__init__
    decoding.greedy_accept = replayed
    SpeculativeBatchGenerator._judge = keyed
    Proposal.__init__ = replayed_confidence
    try:
        yield
    finally:
        decoding.greedy_accept = compare
        SpeculativeBatchGenerator._judge = judge
        Proposal.__init__ = propose


def components(model, drafter, prompt, num_drafts):
    """T_verify and T_draft at the prompt's context depth (seconds), the
    verify at the row count the engine pads ``num_drafts + 1`` tokens to
    (``RoundCosts.cheapest_rows`` over the row counts it measures): on a
    4-bit target on MLX-CUDA 7 rows cost about twice what 8 do, and a bound
    timed at 7 was half what the engine could reach."""
    # Timed before each pair: the pair before's freed caches, kept for
    # reuse, left no room for these at context 8192 on an H100's 80 GB.
    mx.clear_cache()
    target = adapt_target(model, drafter)
    most = verify_rows(num_drafts)
    target_cache = target.make_cache(most)
    draft_cache = drafter.make_cache()
    out = target(prompt[None], target_cache, drafter.taps)
    drafter.commit(draft_cache, out.hidden)
    mx.eval([c.state for c in target_cache + draft_cache])
    anchor = mx.array(7, mx.uint32)

    def verify(rows):
        def run():
            out = target(mx.array([7] * rows, mx.uint32)[None], target_cache, drafter.taps)
            for c in target_cache:
                c.trim(rows)
            return out.logits, out.hidden

        return run

    def draft():
        proposal = drafter.propose(
            draft_cache, anchor, num_drafts, target=target, target_cache=target_cache
        )
        return proposal.tokens, proposal.confidence

    # Each row count from the round's own up, briefly: only the one the
    # engine's rule picks is timed in full.
    tokens = num_drafts + 1
    quick = [seconds(verify(rows), repeats=3, warmup=1) for rows in range(tokens, most + 1)]
    rows = RoundCosts(0.0, [quick[0]] * (tokens - 1) + quick).cheapest_rows(tokens)
    return seconds(verify(rows)), seconds(draft)


def phases(model, drafter, prompt, max_tokens, num_drafts, scheduler=None):
    """Milliseconds per round spent drafting, verifying and on the host (the
    rest: graph building, acceptance, statistics), from one generation whose
    drafts and verifies are each evaluated on the spot (so nothing overlaps:
    the sum is a little above an ordinary round)."""
    spent = {"draft": 0.0, "verify": 0.0}
    adapt, propose = engine.adapt_target, drafter.propose

    def timed(phase, fn):
        def run(*args, **kwargs):
            tic = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval([x for x in vars(out).values() if isinstance(x, (mx.array, list))])
            spent[phase] += time.perf_counter() - tic
            return out

        return run

    def adapt_timed(*args):
        target = adapt(*args)
        forward = timed("verify", target.__call__)
        return type("Timed", (), {"__call__": lambda _, *a: forward(*a),
                                  "__getattr__": lambda _, n: getattr(target, n)})()

    stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
    steps = mlx_dspark.speculative_generate_step(
        prompt, model, drafter, max_tokens=max_tokens, num_draft_tokens=num_drafts,
        stats=stats, scheduler=scheduler,
    )
    engine.adapt_target, drafter.propose = adapt_timed, timed("draft", propose)
    try:
        next(steps)  # the prompt
        spent["verify"] = 0.0
        tic = time.perf_counter()
        for _ in steps:
            pass
        total = time.perf_counter() - tic
    finally:
        engine.adapt_target = adapt
        del drafter.propose
    rounds = max(stats.rounds, 1)
    spent["host"] = total - spent["draft"] - spent["verify"]
    return {k: round(1000 * v / rounds, 3) for k, v in spent.items()}


def generate(steps, repeats):
    """Tokens and median decoding throughput (tokens after the first over the
    time since the first: prompt processing excluded) of ``repeats`` runs of
    the step generator ``steps()``, after a warm-up run."""
    speeds, tokens = [], None
    for _ in progress(range(repeats + 1), desc="runs"):
        tokens, first = [], None
        for step in steps():
            tokens.append(int(step[0]))
            if first is None:
                first = time.perf_counter()
        speeds.append((len(tokens) - 1) / (time.perf_counter() - first))
    return tokens, statistics.median(speeds[1:])


def measure(
    model, drafter, prompt, max_tokens, repeats, num_drafts=None, tau=None, scheduler=None
):
    """Plain vs speculative decoding of ``prompt``, and the round's components.
    With ``tau``, acceptance is replayed (see ``replayed_acceptance``)."""
    num_drafts = num_drafts or drafter.block_size
    context = prompt.size
    plain_tokens, plain_tps = generate(
        lambda: generate_step(prompt, model, max_tokens=max_tokens), repeats
    )
    stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)

    def speculative():
        stats.history.clear()
        return mlx_dspark.speculative_generate_step(
            prompt,
            model,
            drafter,
            max_tokens=max_tokens,
            num_draft_tokens=num_drafts,
            stats=stats,
            scheduler=scheduler,
        )

    if tau is None:
        spec_tokens, spec_tps = generate(speculative, repeats)
    else:
        with replayed_acceptance(tau, num_drafts):
            spec_tokens, spec_tps = generate(speculative, repeats)
    t_verify, t_draft = components(model, drafter, prompt, num_drafts)
    t_decode = 1 / plain_tps
    with replayed_acceptance(tau or 0, num_drafts) if tau else contextlib.nullcontext():
        phase_ms = phases(model, drafter, prompt, max_tokens, num_drafts, scheduler)
    return {
        "plain_tok_s": round(plain_tps, 2),
        "spec_tok_s": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 3),
        "bound_speedup": round(stats.tau * t_decode / (t_verify + t_draft), 3),
        "tau": round(stats.tau, 3),
        "lossless": spec_tokens == plain_tokens if tau is None else "n/a",
        "acceptance": "real"
        if tau is None
        else f"replayed: profile with tau {tau} (synthetic; wall-clock real)",
        "t_decode_ms": round(1000 * t_decode, 3),
        "t_verify_ms": round(1000 * t_verify, 3),
        "t_draft_ms": round(1000 * t_draft, 3),
        "round_phase_ms": phase_ms,
        "scheduler": stats.scheduler,
        "num_draft_tokens": num_drafts,
        "context": context,
        "max_tokens": max_tokens,
        "backend": backend(),
        "machine": platform.machine(),
        "mlx": mx.__version__,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="a short run on the tiny pair"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--shapes", choices=["tiny", "12b"], default="tiny")
    parser.add_argument(
        "--scale", type=int, default=1, help="divide the 12b shapes by this"
    )
    parser.add_argument(
        "--drafter", choices=["dspark", "dflash", "assistant"], default="dspark"
    )
    parser.add_argument("--target-bits", type=int, choices=[4, 8])
    parser.add_argument("--drafter-bits", type=int, choices=[4, 8])
    parser.add_argument(
        "--tau", type=float, default=3.3, help="replayed acceptance length"
    )
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-draft-tokens", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scheduler", choices=["fixed", "cost"])
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 64, 1

    mx.random.seed(0)
    if args.shapes == "tiny":
        if args.drafter == "assistant":
            path = TINY.parent / "assistant-tiny" / "dense"
            model, _ = load(str(path / "target"))
            drafter = mlx_dspark.load_drafter(path / "assistant")
        else:
            model, _ = load(str(TINY / "target_tiny_gemma4"))
            drafter = mlx_dspark.load_drafter(
                TINY / f"{args.drafter}_tiny_gemma4_block4"
            )
        tau = None
    else:
        model = shapes.make_target(args.scale, bits=args.target_bits)
        make = (
            shapes.make_assistant
            if args.drafter == "assistant"
            else shapes.make_drafter
        )
        options = {} if args.drafter == "assistant" else {"variant": args.drafter}
        drafter = make(args.scale, bits=args.drafter_bits, **options)
        tau = args.tau
    vocab = adapt_target(model, drafter).vocab_size
    prompt = mx.random.randint(5, vocab, (args.context,)).astype(mx.uint32)
    result = measure(
        model,
        drafter,
        prompt,
        args.max_tokens,
        args.repeats,
        args.num_draft_tokens,
        tau,
        args.scheduler,
    )
    result.update(
        drafter=args.drafter
        + (f" {args.drafter_bits}-bit" if args.drafter_bits else ""),
        target_bits=args.target_bits or 16,
        shapes="tiny" if args.shapes == "tiny" else f"gemma-4-12b/{args.scale}",
    )
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")


if __name__ == "__main__":
    main()
