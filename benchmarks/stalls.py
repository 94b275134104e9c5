"""The slowest calls of the speculative batch generator's ``next()`` while
sequences leave the batch one by one (each with its own ``max_tokens``), in
a fresh process and then again (shapes compiled), with the fixed policy.

Printed per pass: the total time and the five slowest calls, each with its
index, the batch size before it and whether a sequence finished in it.
"""

import argparse
import contextlib
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

import mlx_dspark
from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.batching.policy import FixedPolicy

import shapes
from batch import prompts
from speculative import TINY, replayed_acceptance


def one_pass(model, drafter, vocab, budgets, context, replay, seed):
    generator = SpeculativeBatchGenerator(
        model, drafter, completion_batch_size=64, policy=FixedPolicy(),
        stream=mx.default_stream(mx.default_device()), pipeline=False,
    )
    calls = []
    with replayed_acceptance(3.3, drafter.block_size, seed=seed) if replay else contextlib.nullcontext():
        generator.insert(prompts(len(budgets), context, vocab, seed), max_tokens=budgets)
        start = time.perf_counter()
        while True:
            batch = len(generator._generation)
            tic = time.perf_counter()
            responses = generator.next_generated()
            if not responses:
                break
            for r in responses:
                r.logprobs[r.token].item()
            calls.append({
                "index": len(calls),
                "batch": batch,
                "seconds": time.perf_counter() - tic,
                "finished": sum(r.finish_reason is not None for r in responses),
            })
        total = time.perf_counter() - start
    return total, calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=["12b"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 96])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.shapes:
        model, drafter = shapes.make_target(1), shapes.make_drafter(1)
        vocab = shapes.target_config(1)["vocab_size"]
    else:
        model, _ = load(str(TINY / "target_tiny_gemma4"))
        drafter = mlx_dspark.load_drafter(TINY / "dspark_tiny_gemma4_block4")
        vocab = model.args.vocab_size
    results = []
    for p in range(2):
        total, calls = one_pass(model, drafter, vocab, args.budgets, args.context, bool(args.shapes), p)
        slowest = sorted(calls, key=lambda c: -c["seconds"])[:5]
        results.append({"pass": p, "total": total, "calls": calls})
        print(f"pass {p}: {total:.2f} s, {len(calls)} calls; slowest: " + ", ".join(
            f"#{c['index']} B={c['batch']}{' finished' if c['finished'] else ''} {1000 * c['seconds']:.0f} ms"
            for c in slowest
        ), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
