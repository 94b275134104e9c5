"""The real-shape benchmark matrix in one process (each model is built once).

For a bf16 and then a 4-bit Gemma-4-12B-shaped target with random weights:

* component costs at each context depth: the target's forward of k = 1..8
  tokens (k = 1 is a decode step), each drafter's round of drafts, and the
  host time to build those graphs (CPU work not overlapped with the device);
* end to end, speculative against plain decoding of the same prompt with
  acceptance replayed at the given tau values (see ``speculative.py``).

Prompts are prefilled in chunks of ``PREFILL_CHUNK`` tokens, as mlx-lm does:
one 8192-token forward of the 4-bit target fails in MLX's CUDA graph builder.

Writes one JSON object per line to ``--out`` (and stdout).
"""

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_dspark
import shapes
from speculative import generate, replayed_acceptance
from timing import backend, seconds

from mlx_dspark.progress import progress
from mlx_dspark.speculative.engine import adapt_target

DRAFTERS = {
    "dspark": dict(variant="dspark"),
    "dspark 8-bit": dict(variant="dspark", bits=8),
    "dspark 4-bit": dict(variant="dspark", bits=4),
    "dflash": dict(variant="dflash"),
    "assistant": None,
}
PREFILL_CHUNK = 2048


def build_time(fn, repeats=5):
    """Median seconds to build ``fn()``'s graph, without evaluating it."""
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return sorted(times)[len(times) // 2]


def components(model, drafters, prompt):
    target = adapt_target(model, next(iter(drafters.values())))
    cache = target.make_cache(9)
    taps = sorted({t for d in drafters.values() for t in d.taps}, key=str)
    hidden = []
    for start in range(0, prompt.size, PREFILL_CHUNK):
        prefill = target(prompt[None, start : start + PREFILL_CHUNK], cache, taps)
        mx.eval(prefill.hidden, [c.state for c in cache])
        hidden.append(prefill.hidden)
    row = {}
    for k in range(1, 9):
        ids = mx.full((1, k), 7, mx.uint32)

        def forward():
            out = target(ids, cache, drafters["dspark"].taps if k > 1 else ())
            for c in cache:
                c.trim(k)
            return out.logits

        row[f"forward_{k}_ms"] = round(1000 * seconds(forward), 3)
    row["host_build_verify_8_ms"] = round(1000 * build_time(forward), 3)
    anchor = mx.array(7, mx.uint32)
    for name, drafter in drafters.items():
        adapt_target(model, drafter)
        dcache = drafter.make_cache()
        for chunk in hidden:
            drafter.commit(dcache, [chunk[taps.index(t)] for t in drafter.taps])
            mx.eval([c.state for c in dcache])

        def draft():
            p = drafter.propose(
                dcache, anchor, drafter.block_size, target=target, target_cache=cache
            )
            return p.tokens, p.confidence

        row[f"draft_{name}_ms"] = round(1000 * seconds(draft), 3)
        row[f"host_build_draft_{name}_ms"] = round(1000 * build_time(draft), 3)
    return row


def end_to_end(model, drafters, prompt, taus, max_tokens, repeats):
    _, plain_tps = generate(
        lambda: generate_step(prompt, model, max_tokens=max_tokens), repeats
    )
    for name, drafter in drafters.items():
        for tau in taus:
            stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)

            def speculative():
                stats.history.clear()
                return mlx_dspark.speculative_generate_step(
                    prompt, model, drafter, max_tokens=max_tokens, stats=stats
                )

            with replayed_acceptance(tau, drafter.block_size):
                _, spec_tps = generate(speculative, repeats)
            yield {
                "drafter": name,
                "replayed_tau": tau,
                "tau": round(stats.tau, 3),
                "plain_tok_s": round(plain_tps, 2),
                "spec_tok_s": round(spec_tps, 2),
                "speedup": round(spec_tps / plain_tps, 3),
            }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--taus", type=float, nargs="+", default=[6.0, 3.3])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--target-bits", type=int, nargs="+", default=[16, 4])
    parser.add_argument("--out", default="suite.jsonl")
    args = parser.parse_args()

    def emit(record):
        record.update(
            backend=backend(), mlx=mx.__version__, shapes=f"gemma-4-12b/{args.scale}"
        )
        line = json.dumps(record)
        print(line, flush=True)
        with open(args.out, "a") as f:
            f.write(line + "\n")

    mx.random.seed(0)
    drafters = {
        name: shapes.make_assistant(args.scale)
        if options is None
        else shapes.make_drafter(args.scale, **options)
        for name, options in DRAFTERS.items()
    }
    model = shapes.make_target(args.scale)
    vocab = model.args.vocab_size
    for bits in args.target_bits:
        if bits != 16:
            shapes.quantize(model, bits)
        for context in progress(args.contexts, desc=f"{bits}-bit target"):
            prompt = mx.random.randint(5, vocab, (context,)).astype(mx.uint32)
            tic = time.perf_counter()
            row = components(model, drafters, prompt)
            emit(
                dict(
                    kind="components",
                    target_bits=bits,
                    context=context,
                    **row,
                    seconds=round(time.perf_counter() - tic, 1),
                )
            )
        prompt = mx.random.randint(5, vocab, (args.contexts[0],)).astype(mx.uint32)
        for record in end_to_end(
            model, drafters, prompt, args.taus, args.max_tokens, args.repeats
        ):
            emit(dict(kind="e2e", target_bits=bits, context=prompt.size, **record))


if __name__ == "__main__":
    main()
