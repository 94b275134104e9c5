"""Verify schedulers compared on the bundled tiny pair: the fixed block, the
per-position threshold and the cost scheduler (Algorithm 1 on this machine's
measured round costs, with the shipped calibration), on the same prompts in
the same run, against plain decoding.

Prints one JSON object per scheduler (``--json``) or a table. The cost
scheduler measures its round costs once per depth bucket into a temporary
cache, outside the timed runs (the warm-up run pays for it).
"""

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

import mlx_dspark

from speculative import TINY, generate
from timing import backend

CALIBRATION = (
    Path(__file__).resolve().parent.parent
    / "examples"
    / "calibration"
    / "dspark_tiny_gemma4_block4.json"
)
SCHEDULERS = {
    "fixed": {},
    "threshold 0.5": {"confidence_threshold": 0.5},
    "cost": {"scheduler": "cost", "calibration": CALIBRATION},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MLX_DSPARK_CACHE", tempfile.mkdtemp())

    model, _ = load(str(TINY / "target_tiny_gemma4"))
    words = random.Random(11)
    prompts = [
        mx.array([words.randrange(5, 512) for _ in range(words.randrange(6, 14))])
        for _ in range(args.prompts)
    ]
    plain = [
        generate(lambda p=p: generate_step(p, model, max_tokens=args.max_tokens), 1)
        for p in prompts
    ]
    for name, options in SCHEDULERS.items():
        drafter = mlx_dspark.load_drafter(TINY / "dspark_tiny_gemma4_block4", **options)
        stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
        speeds, lossless = [], True
        for prompt, (plain_tokens, _) in zip(prompts, plain):
            run = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)

            def steps(prompt=prompt, run=run):
                run.history.clear()
                return mlx_dspark.speculative_generate_step(
                    prompt, model, drafter, max_tokens=args.max_tokens, stats=run
                )

            tokens, speed = generate(steps, args.repeats)
            stats.history += run.history  # the last run's rounds
            speeds.append(speed)
            lossless &= tokens == plain_tokens
        plain_tps = sum(s for _, s in plain) / len(plain)
        spec_tps = sum(speeds) / len(speeds)
        result = {
            "scheduler": name,
            "plain_tok_s": round(plain_tps, 2),
            "spec_tok_s": round(spec_tps, 2),
            "speedup": round(spec_tps / plain_tps, 3),
            "tau": round(stats.tau, 3),
            "verified_per_round": round(stats.drafted / max(stats.rounds, 1), 3),
            "predicted": None if stats.predicted is None else round(stats.predicted, 1),
            "accepted": stats.accepted,
            "lossless": lossless,
            "backend": backend(),
            "shapes": "tiny",
        }
        if args.json:
            print(json.dumps(result))
        else:
            print("  ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
