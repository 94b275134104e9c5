"""Acceptance of a drafter under each acceptance rule, on the same prompts and
seeds: greedy, rejection sampling, and target-sample matching (mlx-lm's rule).

Defaults to the tiny pair bundled with the project. Reports accepted/drafted,
tau (tokens per round) and acceptance by draft position.
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

import mlx_dspark
from mlx_dspark.speculative.sampling import mlx_lm_make_sampler

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"


def measure(model, drafter, sampler, prompts, seeds, max_tokens):
    stats = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
    for prompt in prompts:
        for seed in range(seeds):
            mx.random.seed(seed)
            run = mlx_dspark.SpeculativeStats(drafter.name, drafter.block_size)
            for _ in mlx_dspark.speculative_generate_step(
                mx.array(prompt),
                model,
                drafter,
                max_tokens=max_tokens,
                sampler=sampler,
                stats=run,
            ):
                pass
            stats.history += run.history
            stats.acceptance_rule = run.acceptance_rule
    return stats


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument(
        "--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4")
    )
    parser.add_argument("--temp", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    drafter = mlx_dspark.load_drafter(args.draft_model)
    prompts = [
        tokenizer.encode(p) for p in ("w65 w211 w266 w241", "w10 w20 w30", "w400 w7")
    ]
    samplers = {
        "greedy": None,
        "rejection": mlx_dspark.make_sampler(args.temp),
        # mlx-lm's own sampler carries no distribution: the engine matches samples.
        "match": mlx_lm_make_sampler(args.temp),
    }
    report = {}
    for name, sampler in samplers.items():
        stats = measure(model, drafter, sampler, prompts, args.seeds, args.max_tokens)
        report[name] = dict(
            stats.as_dict(), rate=round(stats.accepted / stats.drafted, 4)
        )
    if args.json:
        print(json.dumps({"temp": args.temp, "rules": report}))
        return
    print(f"temperature {args.temp} ({args.seeds} seeds x {len(prompts)} prompts)")
    for name, r in report.items():
        positions = " ".join(
            "-" if x is None else f"{x:.2f}" for x in r["acceptance_by_position"]
        )
        print(
            f"{name:>10}: {r['accepted']}/{r['drafted']} accepted ({r['rate']:.1%}), "
            f"tau {r['tau']:.2f}, by position [{positions}]"
        )


if __name__ == "__main__":
    main()
