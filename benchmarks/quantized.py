"""Acceptance A/B of a float drafter against its 8-bit and 4-bit conversions
(``mlx_dspark convert``), on the same target, prompts and greedy decoding.

Defaults to the tiny pairs bundled with the project (the DSpark drafter and
the dense Gemma-4 assistant, real acceptance). For each precision it reports
acceptance by draft position, tau (tokens per round), speculative and plain
decoding throughput (prompt processing excluded), their ratio, whether the
output equals plain decoding, and the drafter's weight bytes.
"""

import argparse
import contextlib
import io
import json
import platform
import tempfile
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark.convert import GROUP_SIZES, QUANT_BITS, convert

from speculative import generate
from timing import backend

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
PAIRS = {
    "dspark": (
        FIXTURES / "deepspec-tiny" / "target_tiny_gemma4",
        FIXTURES / "deepspec-tiny" / "dspark_tiny_gemma4_block4",
    ),
    "assistant": (
        FIXTURES / "assistant-tiny" / "dense" / "target",
        FIXTURES / "assistant-tiny" / "dense" / "assistant",
    ),
}
PROMPTS = ("w65 w211 w266 w241", "w10 w20 w30", "w400 w7")


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def throughput(runs):
    """Tokens per second over all prompts: their tokens over their time."""
    tokens = sum(len(t) - 1 for t, _ in runs)
    return tokens / sum((len(t) - 1) / speed for t, speed in runs)


def speculative_steps(model, drafter, prompt, max_tokens, stats):
    """A fresh speculative step generator each call, recording into ``stats``."""

    def steps():
        stats.history.clear()
        return mlx_dspark.speculative_generate_step(
            prompt, model, drafter, max_tokens=max_tokens, stats=stats
        )

    return steps


def measure(model, drafter, prompts, max_tokens, repeats, plain):
    stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
    runs = []
    for prompt in prompts:
        run = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
        steps = speculative_steps(model, drafter, prompt, max_tokens, run)
        runs.append(generate(steps, repeats))
        stats.history += run.history
    spec_tps, plain_tps = throughput(runs), throughput(plain)
    return {
        "tau": round(stats.tau, 3),
        "acceptance_by_position": [
            None if r is None else round(r, 3) for r in stats.acceptance_by_position
        ],
        "spec_tok_s": round(spec_tps, 2),
        "plain_tok_s": round(plain_tps, 2),
        "speedup": round(spec_tps / plain_tps, 3),
        "lossless": [t for t, _ in runs] == [t for t, _ in plain],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    parser.add_argument(
        "--bits", type=int, nargs="+", choices=QUANT_BITS, default=[8, 4]
    )
    parser.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        default=32,
        help="weights per quantization scale (default 32)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for pair in args.pairs:
            target_path, drafter_path = PAIRS[pair]
            model, tokenizer = load(str(target_path))
            prompts = [mx.array(tokenizer.encode(p)) for p in PROMPTS]
            precisions = {"float": drafter_path}
            for bits in args.bits:
                out = Path(scratch) / f"{pair}-{bits}bit"
                with contextlib.redirect_stdout(io.StringIO()):
                    convert(
                        drafter_path, out, q_bits=bits, q_group_size=args.group_size
                    )
                precisions[f"{bits}-bit"] = out
            for precision, path in precisions.items():
                drafter = mlx_dspark.load_drafter(path)
                # Plain decoding again next to each drafter, so that the
                # speedup compares runs close in time on a busy machine.
                plain = [
                    generate(
                        partial(generate_step, p, model, max_tokens=args.max_tokens),
                        args.repeats,
                    )
                    for p in prompts
                ]
                row = {"pair": pair, "precision": precision}
                row.update(
                    measure(
                        model, drafter, prompts, args.max_tokens, args.repeats, plain
                    )
                )
                row.update(
                    drafter_bytes=weight_bytes(path),
                    group_size=None if precision == "float" else args.group_size,
                    prompts=len(prompts),
                    max_tokens=args.max_tokens,
                    backend=backend(),
                    machine=platform.machine(),
                    mlx=mx.__version__,
                )
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    if args.json:
        return
    print(
        f"{'pair':<10} {'drafter':<8} {'tau':>5}  {'acceptance by position':<24} "
        f"{'spec tok/s':>10} {'plain tok/s':>11} {'speedup':>7} {'lossless':>8} "
        f"{'weights':>9}"
    )
    for r in rows:
        positions = " ".join(
            "-" if x is None else f"{x:.2f}" for x in r["acceptance_by_position"]
        )
        print(
            f"{r['pair']:<10} {r['precision']:<8} {r['tau']:>5.2f}  {positions:<24} "
            f"{r['spec_tok_s']:>10.1f} {r['plain_tok_s']:>11.1f} "
            f"{r['speedup']:>7.2f} {r['lossless']!s:>8} "
            f"{r['drafter_bytes'] / 1024:>7.0f}KB"
        )
    print(
        f"({rows[0]['prompts']} prompts x {rows[0]['max_tokens']} tokens, greedy, "
        f"{rows[0]['backend']}, mlx {rows[0]['mlx']})"
    )


if __name__ == "__main__":
    main()
