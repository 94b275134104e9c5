"""``mlx_dspark costs``: measure ahead what ``mlx_lm.server``'s batch policy
measures over its first requests, and what a single stream's ``cost``
scheduler measures over its first generation.

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

A single stream (``mlx_lm.generate``, ``stream_generate``, the server one
request at a time) decodes greedily under ``cost`` by default, and measures
its own costs over its first rounds at each depth bucket, a few verify
lengths a round: on an H200 a fresh machine's first 256-token generation at
12B shapes decoded at 0.31-0.48x of plain decoding, the next one at
0.90-1.02x. This command runs such a generation at each bucket, on a random
prompt, until its costs are measured.
"""

import argparse
import gc
import itertools
import random
import sys
import time
from dataclasses import replace
from typing import Optional

import mlx.core as mx

from ..confidence.costs import depth_bucket, launch_settings_for_speculation
from ..confidence.schedulers import CostScheduler
from ..progress import progress
from ..speculative.engine import speculative_generate_step
from ..validation import check_num_draft_tokens
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


def measure_ahead(
    model, drafter, batches, context: int, vocab_size: int, seed: int = 0,
    num_draft_tokens: Optional[int] = None,
):
    """Yield ``(batch, bucket, RoundCosts, seconds)`` for every batch size and
    depth bucket up to ``context``, measured on a batch of random prompts
    (in ``seconds``, prefill included) unless the profile on disk has them
    (``seconds`` ``None``), for rounds of ``num_draft_tokens`` drafts at
    most (by default the drafter's block size)."""
    rng = random.Random(seed)
    for bucket in buckets(context):
        depth = bucket * 3 // 4
        for batch in batches:
            tic = time.perf_counter()
            generator = SpeculativeBatchGenerator(
                model, drafter, policy=FixedPolicy(), pipeline=False,
                prefill_batch_size=min(batch, PREFILL_BATCH), completion_batch_size=batch,
                num_draft_tokens=num_draft_tokens,
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


class _KeepsTimer(CostScheduler):
    """The ``cost`` scheduler, keeping the timer the engine hands it (its
    key is the profile's)."""

    timer = None

    def profile(self, timer):
        self.timer = timer
        return super().profile(timer)


def measure_stream_ahead(
    model, drafter, context: int, vocab_size: int, seed: int = 0,
    num_draft_tokens: Optional[int] = None,
):
    """Yield ``(bucket, RoundCosts, seconds)`` for every depth bucket up to
    ``context``: a single greedy stream's costs with ``num_draft_tokens``
    drafts a round at most (by default the drafter's block size), measured on the live caches of a generation from a
    random prompt (``seconds``, prefill included) unless the profile on disk
    has them (``seconds`` ``None``). Measured whole once its first round has
    handed the scheduler its timer: left to measure a few lengths a round, a
    generation whose drafts are kept could leave the bucket first. The
    first bucket's timer, without its caches, finds the profile of the
    buckets after it, which are not prefilled where it has them."""
    rng = random.Random(seed)
    key_timer = None
    for bucket in buckets(context):
        depth = bucket * 3 // 4
        prompt = mx.array([rng.randrange(vocab_size) for _ in range(depth)], mx.uint32)
        scheduler = _KeepsTimer(None)
        kept = key_timer and scheduler.profile(key_timer).measured(depth, key_timer)
        if kept:
            yield bucket, kept, None
            continue
        tic = time.perf_counter()
        steps = speculative_generate_step(
            prompt, model, drafter, max_tokens=8, scheduler=scheduler,
            num_draft_tokens=num_draft_tokens,
        )
        for _ in itertools.islice(steps, 2):  # the prompt's token, then a round's
            pass
        profile = scheduler.profile(scheduler.timer)
        kept = profile.measured(depth, scheduler.timer)
        costs = kept or profile.costs(depth, scheduler.timer)
        seconds = None if kept else time.perf_counter() - tic
        key_timer = replace(scheduler.timer, verify=None, draft=None)
        # The generation's caches go before the next bucket's.
        steps.close()
        del steps, scheduler, profile
        gc.collect()
        mx.clear_cache()
        yield bucket, costs, seconds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark costs",
        description="Measure this machine's round costs for mlx_lm.server with a "
        "drafter (the cost batch policy) before it serves, and for a single "
        "stream (mlx_lm.generate), so that their first requests at each batch "
        "size and context depth do not pay for them.",
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
    p.add_argument(
        "--num-draft-tokens", type=int,
        help="drafts a round at most, as the server or mlx_lm.generate is given "
        "them (default: the drafter's block size, their default too)",
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
        if args.num_draft_tokens is not None:
            check_num_draft_tokens(args.num_draft_tokens, drafter, "--num-draft-tokens")
        # As the server with this drafter launches its rounds (and keys its costs).
        launch_settings_for_speculation(model)
    except ValueError as e:
        print(f"mlx_dspark costs: error: {e}", file=sys.stderr)
        return 2
    batches = sorted(set(args.batch))
    jobs = (len(batches) + 1) * len(buckets(args.context))
    streams = (
        ("stream", bucket, costs, seconds)
        for bucket, costs, seconds in measure_stream_ahead(
            model, drafter, args.context, tokenizer.vocab_size,
            num_draft_tokens=args.num_draft_tokens,
        )
    )
    measured = itertools.chain(
        streams,
        measure_ahead(
            model, drafter, batches, args.context, tokenizer.vocab_size,
            num_draft_tokens=args.num_draft_tokens,
        ),
    )
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
    rounds = "a single stream" if batch == "stream" else f"batch {batch:>3}"
    print(
        f"{rounds}, depth bucket {bucket:>6} ({how}): "
        f"draft {1e3 * costs.draft:.1f} ms ({costs.drafts} drafts; one "
        f"{1e3 * costs.drafting(1):.1f} ms), verify of 1..{len(costs.verify)} "
        f"tokens a sequence {verify} ms",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
