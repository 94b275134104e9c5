"""Does the rollback a target's caches are made for change what a round costs?

The ``cost`` scheduler makes the target's caches for 16 rows of rollback (so
that a verify can be padded), ``fixed`` for the drafts plus one; a sliding
window layer's ring then holds ``window - 1 + rows`` slots. On the H200 at 12B
shapes the bf16 assistant under ``cost`` verified the same 7 rows as under
``fixed`` and its verify phase took 40 ms against 26 (BENCHMARKS.md, "Session
20"). This times the verify of the anchor and the drafter's drafts, and the
drafter's call, on caches made for each ``--rows``, at the prompt's context
depth, in passes over the settings (so drift spreads over all of them).

    python benchmarks/rollback_rows.py --drafter assistant --rows 7 16 --context 2048
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

from mlx_dspark.speculative.engine import adapt_target

import shapes
from timing import backend


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--target-bits", type=int, default=16)
    parser.add_argument("--drafter", choices=["dspark", "assistant"], default="assistant")
    parser.add_argument("--rows", type=int, nargs="+", default=[7, 16])
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()

    mx.random.seed(0)
    model = shapes.make_target(args.scale, bits=None if args.target_bits == 16 else args.target_bits)
    drafter = (
        shapes.make_assistant(args.scale)
        if args.drafter == "assistant"
        else shapes.make_drafter(args.scale)
    )
    target = adapt_target(model, drafter)
    drafts = drafter.block_size
    prompt = mx.random.randint(5, model.args.vocab_size, (1, args.context)).astype(mx.uint32)
    anchor = mx.array(7, mx.uint32)
    verify_ids = mx.array([[7] * (drafts + 1)], mx.uint32)

    caches = {}
    for rows in args.rows:
        target_cache, draft_cache = target.make_cache(rows), drafter.make_cache()
        out = target(prompt, target_cache, drafter.taps)
        drafter.commit(draft_cache, out.hidden)
        mx.eval([c.state for c in target_cache + draft_cache])
        caches[rows] = (target_cache, draft_cache)

    def verify(target_cache, _):
        out = target(verify_ids, target_cache, drafter.taps)
        mx.eval(out.logits, out.hidden)
        for c in target_cache:
            c.trim(drafts + 1)

    def draft(target_cache, draft_cache):
        proposal = drafter.propose(
            draft_cache, anchor, drafts, target=target, target_cache=target_cache
        )
        mx.eval(proposal.tokens)

    parts = {"verify": verify, "draft": draft}
    times = {(rows, part): [] for rows in args.rows for part in parts}
    for i in range(args.passes + 1):
        for rows, cache in caches.items():
            for part, fn in parts.items():
                fn(*cache)  # once untimed: a change of cache compiles on first use
                tic = time.perf_counter()
                fn(*cache)
                if i:
                    times[rows, part].append(time.perf_counter() - tic)
    report = {
        "drafter": args.drafter,
        "drafts": drafts,
        "target_bits": args.target_bits,
        "context": args.context,
        "backend": backend(),
        "mlx": mx.__version__,
        "shapes": f"gemma-4-12b/{args.scale}",
        "ms": {
            f"{rows} rows": {
                part: round(1000 * statistics.median(times[rows, part]), 2) for part in parts
            }
            for rows in args.rows
        },
    }
    print(json.dumps(report))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
