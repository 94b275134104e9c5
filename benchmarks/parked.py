"""What a parked round (a speculative generation's round without drafts)
costs against mlx-lm's plain decoding step, and where the difference goes.

A generation whose drafts do not pay decodes plainly inside the speculative
engine. It is never slower than plain decoding only if such a round is no
slower than mlx-lm's ``generate_step``. Each variant decodes
``--max-tokens`` tokens after a ``--context``-token prompt, pipelined as
``generate_step`` pipelines (the next step built and started before the
current token is read), and adds one piece of the engine's round at a time:

- ``stock``: ``generate_step`` itself;
- ``rollback caches``: the model's own forward on the target's rollback caches;
- ``tapped``: the target adapter's forward with the drafter's taps;
- ``committed``: and the drafter taking in the taps;
- ``engine``: ``speculative_generate_step`` with every round parked;
- ``engine, cost``: under the ``cost`` scheduler, drafts never accepted
  (replayed): its pacing parks, and probes now and then.

Variants run in turn, ``--passes`` times (so drift spreads over all of
them); each reports its median tokens per second and its ratio to ``stock``
in the same pass.

    python benchmarks/parked.py --target-bits 4 --drafter assistant --context 2048

``--model``/``--draft-model`` time a real pair instead of random 12B shapes
(e.g. the tiny pair bundled in ``tests/fixtures``, where the host's work
weighs most).
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark.speculative import engine
from mlx_dspark.speculative.pacing import FixedPacing

import shapes
from speculative import replayed_acceptance
from timing import backend


class Parked(FixedPacing):
    """Every round without drafts."""

    def drafts(self, cap: int, depth: int) -> int:
        return 0


def pipelined(step, first, max_tokens):
    """``generate_step``'s loop: the next step is built and started before
    the current token is read."""
    y = first
    mx.async_eval(y)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            next_y = step(y)
            mx.async_eval(next_y)
        yield y.item()
        if n + 1 < max_tokens:
            y = next_y


def _spread(gaps):
    """Quantiles of the times between tokens (ms), and the share of the
    total time in gaps over twice the median."""
    ordered = sorted(gaps)
    median = ordered[len(ordered) // 2]
    return {
        "p10": round(1e3 * ordered[len(ordered) // 10], 2),
        "p50": round(1e3 * median, 2),
        "p90": round(1e3 * ordered[9 * len(ordered) // 10], 2),
        "max": round(1e3 * ordered[-1], 2),
        "stalled": round(sum(g for g in gaps if g > 2 * median) / sum(gaps), 3),
    }


def _stalls(gaps, over=2.5):
    """``[token index, ms]`` of the gaps over ``over`` times the median."""
    median = sorted(gaps)[len(gaps) // 2]
    return [[i, round(1e3 * g, 1)] for i, g in enumerate(gaps) if g > over * median]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--target-bits", type=int, default=16)
    parser.add_argument("--drafter", choices=["dspark", "assistant"], default="assistant")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--variants", nargs="+", help="a subset of the variants (stock always runs)")
    parser.add_argument("--model", help="a target's path, instead of random 12B shapes")
    parser.add_argument("--draft-model", help="its drafter's path (with --model)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if bool(args.model) != bool(args.draft_model):
        parser.error("--model and --draft-model go together")

    mx.random.seed(0)
    if args.model:
        model = load(args.model)[0]
        drafter = mlx_dspark.load_drafter(args.draft_model)
    else:
        model = shapes.make_target(
            args.scale, bits=None if args.target_bits == 16 else args.target_bits
        )
        drafter = (
            shapes.make_assistant(args.scale)
            if args.drafter == "assistant"
            else shapes.make_drafter(args.scale)
        )
    target = engine.adapt_target(model, drafter)
    rows = drafter.block_size + 1
    prompt = mx.random.randint(5, target.vocab_size, (args.context,)).astype(mx.uint32)

    def greedy(logits):
        return mx.argmax(logits[:, -1], axis=-1).astype(mx.uint32)

    def stock():
        return (int(t) for t, _ in generate_step(prompt, model, max_tokens=args.max_tokens))

    def on_caches(tapped: bool, committed: bool):
        target_cache, draft_cache = target.make_cache(rows), drafter.make_cache()
        taps = drafter.taps if tapped else ()
        out = target(prompt[None], target_cache, drafter.taps)
        drafter.commit(draft_cache, out.hidden)
        mx.eval([c.state for c in target_cache + draft_cache])

        def step(y):
            if not tapped:
                return greedy(model(y[None], cache=target_cache))
            out = target(y[None], target_cache, taps)
            if committed:
                drafter.commit(draft_cache, out.hidden)
            return greedy(out.logits)

        return pipelined(step, greedy(out.logits), args.max_tokens)

    def parked():
        steps = mlx_dspark.speculative_generate_step(
            prompt, model, drafter, max_tokens=args.max_tokens, scheduler="fixed"
        )
        return (int(t) for t, _, _ in steps)

    paced_stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)

    def paced():
        paced_stats.history.clear()
        with replayed_acceptance(1.0, drafter.block_size):
            steps = mlx_dspark.speculative_generate_step(
                prompt, model, drafter, max_tokens=args.max_tokens, scheduler="cost",
                stats=paced_stats,
            )
            yield from (int(t) for t, _, _ in steps)

    variants = {
        "stock": stock,
        "rollback caches": lambda: on_caches(False, False),
        "tapped": lambda: on_caches(True, False),
        "committed": lambda: on_caches(True, True),
        "engine": parked,
        "engine, cost": paced,
    }
    if args.variants:
        variants = {n: v for n, v in variants.items() if n == "stock" or n in args.variants}
    speeds = {name: [] for name in variants}
    # Each token's time after the one before it, over every pass: a slow
    # variant's loss is either spread over its rounds or in a few stalls,
    # which the last pass lists (token index, ms).
    gaps = {name: [] for name in variants}
    stalls = {}
    pacing_for = engine.pacing_for
    engine.pacing_for = lambda scheduler, *args: (
        Parked() if scheduler.name == "fixed" else pacing_for(scheduler, *args)
    )
    try:
        for i in range(args.passes + 1):
            for name, steps in variants.items():
                times = [time.perf_counter() for _ in steps()]
                if i:  # the first pass warms up
                    speeds[name].append((len(times) - 1) / (times[-1] - times[0]))
                    gaps[name].extend(b - a for a, b in zip(times, times[1:]))
                    stalls[name] = _stalls([b - a for a, b in zip(times, times[1:])])
    finally:
        engine.pacing_for = pacing_for
    report = {
        "drafter": args.draft_model or args.drafter,
        "target_bits": None if args.model else args.target_bits,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "backend": backend(),
        "mlx": mx.__version__,
        "shapes": args.model or f"gemma-4-12b/{args.scale}",
        "tok_s": {name: round(statistics.median(s), 2) for name, s in speeds.items()},
        "token_ms": {name: _spread(g) for name, g in gaps.items()},
        "last_pass_stalls": stalls,
        # The rounds of the last ``engine, cost`` pass that drafted (probes).
        "paced_drafted_rounds": [i for i, r in enumerate(paced_stats.history) if r.proposed],
        "x_stock": {
            name: round(statistics.median(a / b for a, b in zip(s, speeds["stock"])), 3)
            for name, s in speeds.items()
        },
    }
    print(json.dumps(report))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
