"""Calibrate a DSpark drafter's confidences, then compare the fixed,
threshold and cost schedulers on the same prompts.

Runs `mlx_dspark calibrate` (to --out, by default a temporary file, so the
drafter's own calibration is left alone), then generates with each scheduler:
tokens per second, τ, drafts verified per round, and predicted against
realised accepted drafts. The output is the same whichever scheduler runs.
"""

import argparse
import tempfile
import time
from pathlib import Path

from mlx_lm import load

import mlx_dspark
from mlx_dspark.confidence import calibrate

HERE = Path(__file__).resolve().parent
TINY = HERE.parent / "tests" / "fixtures" / "deepspec-tiny"


def run(model, tokenizer, drafter, prompts, max_tokens):
    """Tokens, tokens per second and the statistics of every prompt."""
    stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
    outputs, count, tic = [], 0, time.perf_counter()
    for prompt in prompts:
        tokens = []
        for response in mlx_dspark.stream_generate(
            model, tokenizer, prompt, draft=drafter, max_tokens=max_tokens
        ):
            tokens.append(response.token)
        stats.history += response.stats.history
        outputs.append(tokens)
        count += len(tokens)
    return outputs, count / (time.perf_counter() - tic), stats


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument("--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4"))
    parser.add_argument(
        "--prompts",
        default=str(HERE / "calibration" / "tiny_prompts.txt"),
        help="a .jsonl or text file of prompts (see `mlx_dspark calibrate`)",
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--out", help="where to write the calibration")
    args = parser.parse_args()

    out = args.out or str(Path(tempfile.mkdtemp()) / "calibration.json")
    status = calibrate.main(
        ["--model", args.model, "--draft-model", args.draft_model,
         "--prompts", args.prompts, "--max-tokens", str(args.max_tokens), "--out", out]
    )  # fmt: skip
    if status:
        raise SystemExit(status)

    model, tokenizer = load(args.model)
    prompts = calibrate.read_prompts(Path(args.prompts))[:8]
    schedulers = {
        "fixed": {"scheduler": "fixed"},
        f"threshold {args.threshold}": {"confidence_threshold": args.threshold},
        "cost": {"scheduler": "cost", "calibration": out},
    }
    # Warm-up, so that the first scheduler is not timed with one-off costs.
    run(model, tokenizer, mlx_dspark.load_drafter(args.draft_model), prompts[:1], 8)
    reference = None
    print("\nscheduler        tok/s   tau  verified/round  predicted/accepted")
    for name, options in schedulers.items():
        drafter = mlx_dspark.load_drafter(args.draft_model, **options)
        outputs, speed, stats = run(model, tokenizer, drafter, prompts, args.max_tokens)
        reference = reference or outputs
        predicted = "-" if stats.predicted is None else f"{stats.predicted:.1f}"
        print(
            f"{name:<15} {speed:6.1f}  {stats.tau:4.2f}  "
            f"{stats.drafted / max(stats.rounds, 1):14.2f}  "
            f"{predicted:>9} / {stats.accepted}"
        )
        assert outputs == reference, "the schedulers' outputs differ"
    print("Every scheduler gave the same output.")


if __name__ == "__main__":
    main()
