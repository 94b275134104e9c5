"""Speculative vs plain decoding in the same run on the same machine.

Reports generation throughput of both (prompt processing excluded), their
ratio, the drafter's tau, and whether the outputs were identical. Defaults to
the tiny pair bundled with the project; pass --model/--draft-model for real
checkpoints.
"""

import argparse
import json
import platform
import statistics
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm import stream_generate as mlx_lm_stream_generate

import mlx_dspark

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"


def run(generate, repeats):
    speeds, tokens, last = [], None, None
    for _ in range(repeats + 1):  # the first run warms up
        responses = list(generate())
        last = responses[-1]
        speeds.append(last.generation_tps)
        tokens = [r.token for r in responses]
    return statistics.median(speeds[1:]), tokens, last


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument(
        "--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4")
    )
    parser.add_argument(
        "--prompt", default="w65 w211 w266 w241 w234 w10 w325 w168 w387 w454"
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    drafter = mlx_dspark.load_drafter(args.draft_model)
    plain_tps, plain_tokens, _ = run(
        lambda: mlx_lm_stream_generate(
            model, tokenizer, args.prompt, max_tokens=args.max_tokens
        ),
        args.repeats,
    )
    spec_tps, spec_tokens, last = run(
        lambda: mlx_dspark.stream_generate(
            model,
            tokenizer,
            args.prompt,
            draft=drafter,
            max_tokens=args.max_tokens,
            num_draft_tokens=args.num_draft_tokens,
        ),
        args.repeats,
    )
    result = {
        "plain_tok_s": round(plain_tps, 2),
        "spec_tok_s": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 3),
        "tau": round(last.stats.tau, 3),
        "lossless": spec_tokens == plain_tokens,
        "drafter": last.stats.drafter,
        "max_tokens": args.max_tokens,
        "backend": str(mx.default_device()),
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "model": args.model,
        "draft_model": args.draft_model,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>12}: {value}")


if __name__ == "__main__":
    main()
