"""A 4-bit target's verify with and without the engine's multirow kernel
(``mlx_dspark.targets.multirow``: on MLX-CUDA, 2-8 rows of a 4-bit
projection by a kernel that reads each packed weight once for all the
rows), and the kernel against MLX-CUDA's own per projection shape.

MLX 0.32.4's CUDA backend runs 2-7 rows of an affine 4-bit matmul as one
matrix-vector product a row, each reading the whole weight again, and 8 or
more as a tiled product that leaves the GPU mostly idle at the 12B's widths
(``quantized_rows.py``, ``split_k.py``).

It checks the kernel per 12B projection shape against a float32 reference
(and MLX's own kernel against the same) and times it against MLX's, then
times the verify (on the engine's caches, at ``--context``) as MLX runs it,
with every routed module's 2-8 rows by the kernel (and how far the logits
moved), and as the engine routes it on MLX-CUDA: by the kernel only at the
shapes and rows ``multirow.choose`` timed it faster (``chosen``; the cache
folder keeps a machine's choices, so its ``choose_s`` is the timing only
where the folder is fresh). JSON lines to stdout (and ``--out``). CUDA only.

    python multirow_qmv.py --rows 1 2 4 8
"""

import argparse
import functools
import json
import time

import mlx.core as mx
from mlx_dspark.targets import multirow

from fused_projections import prefilled, report, verify_logits, verify_ms
import quantized_rows
from quantized_rows import GROUP_SIZE, layer_shapes
from timing import backend


def kernel_product(x, w, bits: int):
    """``quantized_rows.chained``'s matmul ([1, M, K] inputs) by the kernel."""
    return multirow.multirow_matmul(x[0], *w, GROUP_SIZE)[None]


def shape_report(rows, cache_mb: int, repeats: int) -> dict:
    """Per 12B projection shape and row count: the largest error of the
    kernel and of MLX's
    ``quantized_matmul`` against float32 (over the reference's largest
    value), and the ms a matmul of each takes, each waiting for the one
    before over weight copies beyond the cache (``quantized_rows.chained``:
    a small copy a link included); MLX's at one row too, the kernel's
    baseline."""
    by_shape = {}
    for name, (inputs, outputs) in layer_shapes().items():
        made = quantized_rows.weights(inputs, outputs, 1, 4)
        q = made[0]
        exact = mx.dequantize(*q, group_size=GROUP_SIZE, bits=4).astype(mx.float32)
        by_shape[name] = {}
        for m in rows:
            x = mx.random.normal((m, inputs)).astype(mx.bfloat16)
            reference = x.astype(mx.float32) @ exact.T
            size = mx.abs(reference).max()
            products = {
                "mlx": mx.quantized_matmul(x, *q, transpose=True, group_size=GROUP_SIZE, bits=4),
                "kernel": multirow.multirow_matmul(x, *q, GROUP_SIZE),
            }
            by_shape[name][m] = {
                key: round((mx.abs(y.astype(mx.float32) - reference).max() / size).item(), 5)
                for key, y in products.items()
            }
        del exact
        copies = quantized_rows.copies_beyond(cache_mb * 2**20, sum(a.nbytes for a in q))
        made += quantized_rows.weights(inputs, outputs, copies - 1, 4)
        for m in [1] + list(rows):
            x = mx.random.normal((1, m, inputs)).astype(mx.bfloat16)
            mx.eval(x)
            products = {"mlx_ms": quantized_rows.matmul}
            if m in multirow.ROWS:
                products["kernel_ms"] = kernel_product
            entry = by_shape[name].setdefault(m, {})
            for key, product in products.items():
                chain = functools.partial(quantized_rows.chained, x, made, 4, product)
                entry[key] = round(1000 * quantized_rows.seconds(chain, repeats) / copies, 4)
        del made
        mx.clear_cache()
    return by_shape


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 3, 2, 4, 8],
        help="verify rows; the first verify of each is timed too (3 first: its kernels are not "
        "compiled by the shape report's rows)",
    )
    parser.add_argument("--check-rows", type=int, nargs="+", default=[2, 4, 8], help="rows each shape is checked and timed at")
    parser.add_argument("--cache-mb", type=int, default=60, help="the GPU's last-level cache")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--scale", type=int, default=1, choices=[1, 2, 4], help="shrink the 12B shapes")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    shapes_report = shape_report(args.check_rows, args.cache_mb, args.repeats)
    print(json.dumps({"shapes": shapes_report}), flush=True)

    model, drafter, target, cache = prefilled(args.scale, 4, max(args.rows + [8]), args.context)
    before = {rows: round(verify_ms(target, cache, drafter.taps, rows), 2) for rows in args.rows}
    reference = verify_logits(target, cache, drafter.taps, 8)
    routed = multirow.route(model)
    first = {}
    for rows in args.rows:  # a fresh process: what its first verify waits, compiles included
        tic = time.perf_counter()
        verify_logits(target, cache, drafter.taps, rows)
        first[rows] = round(time.perf_counter() - tic, 2)
    logits = verify_logits(target, cache, drafter.taps, 8)
    every_row = {rows: round(verify_ms(target, cache, drafter.taps, rows), 2) for rows in args.rows}
    tic = time.perf_counter()
    kept = multirow.choose(model)  # as the engine routes: where this machine timed the kernel faster
    choosing = round(time.perf_counter() - tic, 2)
    line = {
        "bits": 4,
        "backend": backend(),
        "mlx": mx.__version__,
        "context": args.context,
        "modules_routed": routed,
        "columns": multirow.COLUMNS,
        "verify_ms": before,
        "multirow": {
            "first_verify_s": first,
            "verify_ms": every_row,
            "logits_max_change": float(mx.abs(logits - reference).max()),
            "same_argmax": float((logits.argmax(-1) == reference.argmax(-1)).astype(mx.float32).mean()),
        },
        "chosen": {
            "choose_s": choosing,
            "modules_routed": kept,
            "routing": multirow.routing(model),
            "verify_ms": {rows: round(verify_ms(target, cache, drafter.taps, rows), 2) for rows in args.rows},
        },
        "logits_max": float(mx.abs(reference).max()),
        "shapes": shapes_report,
    }
    return report(line, args.out)


if __name__ == "__main__":
    main()
