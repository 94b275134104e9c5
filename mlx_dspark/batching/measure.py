"""``mlx_dspark costs``: measure ahead what ``mlx_lm.server``'s batch policy
measures over its first requests.

With a drafter, the server's ``cost`` policy chooses each round's drafts from
the costs of a round for the batch's size at its context depth, measured on
this machine (``SpeculativeBatchGenerator.measured_costs``). A size and depth
bucket not measured yet is measured on the live batch, a few verifies a round
(a second or more of a request's time at 12B on a GPU, for each of them), and
kept on disk. This command measures them before the server serves anyone:
for each batch size (powers of two; the server interpolates the others) and
each depth bucket up to ``--context``, it prefills that many random prompts
to three quarters of the bucket and times the rounds there, into the same
profile the server reads. Profiles are kept for a week, per target, drafter,
MLX version and device (``confidence.costs``).
"""

import argparse
import gc
import random
import sys
import time

import mlx.core as mx

from ..confidence.costs import depth_bucket, launch_settings_for_speculation
from ..progress import progress
from .generator import SpeculativeBatchGenerator
from .policy import FixedPolicy

DEFAULT_BATCHES = (1, 2, 4, 8, 16)
DEFAULT_CONTEXT = 2048
PREFILL_BATCH = 8  # prompts prefilled together, as mlx_lm.server's default


def buckets(context: int) -> list:
    """The depth buckets a server meets up to ``context`` tokens."""
    found, bucket = [], depth_bucket(1)
    while True:
        found.append(bucket)
        if bucket >= context:
            return found
        bucket = depth_bucket(bucket + 1)


def measure_ahead(model, drafter, batches, context: int, vocab_size: int, seed: int = 0):
    """Yield ``(batch, bucket, RoundCosts, seconds)`` for every batch size and
    depth bucket up to ``context``, measured on a batch of random prompts
    (in ``seconds``, prefill included) unless the profile on disk has them
    (``seconds`` ``None``)."""
    rng = random.Random(seed)
    for bucket in buckets(context):
        depth = bucket * 3 // 4
        for batch in batches:
            tic = time.perf_counter()
            generator = SpeculativeBatchGenerator(
                model, drafter, policy=FixedPolicy(), pipeline=False,
                prefill_batch_size=min(batch, PREFILL_BATCH), completion_batch_size=batch,
            )
            costs = generator.profiled_costs(batch, depth)
            if costs is not None:
                yield batch, bucket, costs, None
                continue
            # No budget ends while later prompts are prefilled: every
            # sequence is in the batch measured.
            prompts = [[rng.randrange(vocab_size) for _ in range(depth)] for _ in range(batch)]
            generator.insert(prompts, max_tokens=[1 << 30] * batch)
            started = set()
            while len(started) < batch:
                _, responses = generator.next()
                started.update(r.uid for r in responses)
            costs = generator.measure_costs()
            # The generator and its caches go before the next size's.
            del generator
            gc.collect()
            mx.clear_cache()
            yield batch, bucket, costs, time.perf_counter() - tic


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark costs",
        description="Measure this machine's round costs for mlx_lm.server with a "
        "drafter (the cost batch policy) before it serves, so that its first "
        "requests at each batch size and context depth do not pay for them.",
    )
    p.add_argument("--model", required=True, help="the target (path or Hub id)")
    p.add_argument("--draft-model", required=True, help="the drafter (path or Hub id)")
    p.add_argument(
        "--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES),
        help="batch sizes to measure, powers of two (default: 1 2 4 8 16; the "
        "server interpolates between them and measures larger ones itself)",
    )
    p.add_argument(
        "--context", type=int, default=DEFAULT_CONTEXT,
        help=f"measure every depth bucket (powers of two from 512) up to this "
        f"many tokens of context (default {DEFAULT_CONTEXT})",
    )
    return p


def check(args) -> None:
    if args.context < 1:
        raise ValueError("--context must be positive")
    odd = [b for b in args.batch if b < 1 or b & (b - 1)]
    if odd:
        raise ValueError(
            f"--batch takes powers of two (the sizes the server measures), not "
            f"{', '.join(map(str, odd))}"
        )


def main(argv=None) -> int:
    from ..doctor import load_pair

    args = parser().parse_args(argv)
    try:
        check(args)
        model, tokenizer, drafter, _ = load_pair(args.model, args.draft_model, None)
        # As the server with this drafter launches its rounds (and keys its costs).
        launch_settings_for_speculation(model)
    except ValueError as e:
        print(f"mlx_dspark costs: error: {e}", file=sys.stderr)
        return 2
    batches = sorted(set(args.batch))
    jobs = len(batches) * len(buckets(args.context))
    measured = measure_ahead(model, drafter, batches, args.context, tokenizer.vocab_size)
    try:
        for batch, bucket, costs, seconds in progress(measured, total=jobs, desc="measuring"):
            report(batch, bucket, costs, seconds)
    except RuntimeError as e:  # MLX's out-of-memory among them
        print(
            f"mlx_dspark costs: error: {e} (measure fewer or smaller batches, or a "
            "shorter --context)",
            file=sys.stderr,
        )
        return 1
    return 0


def report(batch, bucket, costs, seconds) -> None:
    verify = " ".join(f"{1e3 * c:.1f}" for c in costs.verify)
    how = "kept" if seconds is None else f"measured in {seconds:.1f} s"
    print(
        f"batch {batch:>3}, depth bucket {bucket:>6} ({how}): "
        f"draft {1e3 * costs.draft:.1f} ms, verify of 1..{len(costs.verify)} "
        f"tokens a sequence {verify} ms",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
