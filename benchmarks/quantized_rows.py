"""What a target's matmuls cost by rows: a verify of ``k + 1`` tokens runs
every linear layer on ``k + 1`` rows where a plain step runs it on one.

For each row count, the Gemma-4-12B layer's linear shapes (attention
projections, the MLP, the tied output head), each over distinct weight
copies whose bytes come to at least four times ``--cache-mb`` (the GPU's
last-level cache: 50 MB on an H100, 60 on an H200), so that the weights are
read from device memory as in a forward, not from the cache. Each shape is
timed 4-bit (MLX's affine quantization, group 64, as
``mlx-community/gemma-4-12b-it-4bit``) and bf16, each row count against one
row of the same precision (each shape in ms per copy, with the copy of
its rows that passes them on, so against the forward's own verify the sums
run high: one row's is each launch's cost, see ``chained``).
JSON lines to stdout (and ``--out``).

On MLX-CUDA a 4-bit verify of 8 rows cost about three plain steps where a
bf16 one cost 1.3 (``results/h200-verify-cost-profiles-s34``); this says
which matmuls make that.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

from timing import backend

GROUP_SIZE = 64


def layer_shapes(scale: int = 1) -> dict:
    """(inputs, outputs) of a 12B layer's linear maps, and of the head;
    ``scale`` divides each width (to whole quantization groups)."""

    def width(n: int) -> int:
        return max(GROUP_SIZE, n // scale // GROUP_SIZE * GROUP_SIZE)

    hidden, mlp, heads, kv = width(3840), width(15360), width(16 * 256), width(8 * 256)
    return {
        "q_proj": (hidden, heads),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads, hidden),
        "gate_proj": (hidden, mlp),
        "up_proj": (hidden, mlp),
        "down_proj": (mlp, hidden),
        "lm_head": (hidden, width(262144)),
    }


def weights(inputs: int, outputs: int, copies: int, bits: int) -> list:
    made = []
    for _ in range(copies):
        w = (mx.random.normal((outputs, inputs)) * inputs**-0.5).astype(mx.bfloat16)
        made.append(w if bits == 16 else mx.quantize(w, group_size=GROUP_SIZE, bits=bits))
        mx.eval(made[-1])
    return made


def matmul(x, w, bits: int):
    if bits == 16:
        return x @ w.T
    return mx.quantized_matmul(x, *w, transpose=True, group_size=GROUP_SIZE, bits=bits)


def chained(x, made: list, bits: int, product=matmul):
    """``x`` through each weight copy in turn, each matmul reading the one
    before's outputs, as a forward's layers do: independent matmuls run side
    by side on a GPU and hide what one costs on its own (on an H100, 48 of
    the 4-bit 12B's MLPs at 8 rows took 5.4 ms side by side where a forward's
    took about 20 ms more than at one row). ``mx.depends`` would not order
    them on MLX-CUDA: it launches nothing, so the next matmul, reading ``x``,
    would wait for nothing. Each link copies the rows it passes on (tiled or
    cut to the chain's width: a kernel of a few microseconds, growing with
    the rows), so a shape's time carries its copy, and where a matmul takes
    tens of microseconds its ratios to one row understate. ``product``
    computes each matmul (``matmul`` by default: MLX's)."""
    inputs = x.shape[-1]
    for w in made:
        y = product(x, w, bits)
        x = mx.tile(y, (1, 1, -(-inputs // y.shape[-1])))[..., :inputs]
    return x


def seconds(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` evaluated, after two untimed calls."""
    times = []
    for i in range(repeats + 2):
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    return statistics.median(times[2:])


def copies_beyond(cache_bytes: int, one_copy: int) -> int:
    """Weight copies whose bytes are at least four times the cache's."""
    return max(1, -(-4 * cache_bytes // one_copy))


def measure(shapes: dict, rows: list, cache_bytes: int, bits: int, repeats: int) -> dict:
    """Milliseconds of a matmul of each shape, by row count: the mean over
    weight copies well beyond the cache, each waiting for the one before."""
    report = {}
    for name, (inputs, outputs) in shapes.items():
        one = weights(inputs, outputs, 1, bits)[0]
        copies = copies_beyond(cache_bytes, sum(a.nbytes for a in ([one] if bits == 16 else one)))
        made = [one] + weights(inputs, outputs, copies - 1, bits)
        report[name] = {}
        for m in rows:
            x = mx.random.normal((1, m, inputs)).astype(mx.bfloat16)
            mx.eval(x)
            report[name][m] = 1000 * seconds(lambda: chained(x, made, bits), repeats) / copies
        del one, made
        mx.clear_cache()
    return report


def rows_against_one(report: dict, depth: int) -> dict:
    """A forward's matmuls (``depth`` layers of each shape's, the head once)
    by row count, in ms and against one row."""
    per_layer = {m: sum(v[m] for k, v in report.items() if k != "lm_head") for m in report["lm_head"]}
    forward = {m: depth * per_layer[m] + report["lm_head"][m] for m in per_layer}
    one = forward[min(forward)]
    return {m: {"ms": round(ms, 3), "vs_one_row": round(ms / one, 3)} for m, ms in forward.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 32])
    parser.add_argument("--cache-mb", type=int, default=60, help="the GPU's last-level cache")
    parser.add_argument("--depth", type=int, default=48, help="layers of the forward reported")
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--scale", type=int, default=1, help="divide the widths (a quick run)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if 1 not in args.rows:
        parser.error("--rows must include 1: every row count is read against one row")
    shapes = layer_shapes(args.scale)
    lines = []
    for bits in args.bits:
        report = measure(shapes, sorted(args.rows), args.cache_mb << 20, bits, args.repeats)
        lines.append({
            "bits": bits,
            "backend": backend(),
            "mlx": mx.__version__,
            "cache_mb": args.cache_mb,
            "forward": rows_against_one(report, args.depth),
            "shapes_ms": {name: {m: round(ms, 4) for m, ms in by_rows.items()} for name, by_rows in report.items()},
        })
        print(json.dumps(lines[-1]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
