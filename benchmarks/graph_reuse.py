"""Whether a forward costs more when the context it attends to changes
length between calls, as every speculative round's does.

On MLX-CUDA, rounds ran 20-30% faster with CUDA graphs off
(``MLX_USE_CUDA_GRAPHS=0``, BENCHMARKS.md session 18) while plain decoding
did not. MLX updates a cached CUDA graph when the next one has the same
topology and instantiates a new one otherwise. This times the target's
forward of ``rows`` tokens through mlx-lm's caches, median of ``--repeats``:

- ``fixed``: at one depth, the cache trimmed back after each forward;
- ``advancing``: the depth growing by ``rows`` after each forward, as
  decoding (``rows`` 1) and verifying ``rows - 1`` drafts do.

Run once with graphs on and once with ``MLX_USE_CUDA_GRAPHS=0``.

    python graph_reuse.py --shapes 12b --rows 1 8
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import shapes
from timing import backend


def forward_ms(model, context, rows, repeats, advance):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(context, dtype=mx.uint32)[None] % 1000 + 5, cache=cache))
    mx.eval([c.state for c in cache])
    inputs = mx.arange(rows, dtype=mx.uint32)[None] + 7
    times = []
    for i in range(repeats + 3):
        tic = time.perf_counter()
        out = model(inputs, cache=cache)
        mx.eval(out, [c.state for c in cache])
        if i >= 3:
            times.append(time.perf_counter() - tic)
        if not advance:
            for c in cache:
                c.trim(rows)
            mx.eval([c.state for c in cache])
    return 1000 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=["12b"])
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    model = shapes.make_target(1 if args.shapes else args.scale)
    results = []
    for rows in args.rows:
        row = {"rows": rows, "backend": backend()}
        for name, advance in (("fixed", False), ("advancing", True), ("fixed_again", False)):
            row[name] = forward_ms(model, args.context, rows, args.repeats, advance)
        results.append(row)
        print(
            f"{rows} rows: fixed depth {row['fixed']:.2f} ms, advancing {row['advancing']:.2f} ms, "
            f"fixed again {row['fixed_again']:.2f} ms",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
