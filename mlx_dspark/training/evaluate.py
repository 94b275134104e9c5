"""``mlx_dspark evaluate``: the acceptance length τ of drafters on prompts,
decoded by the engine (greedy by default), and whether the output equals
the target's own greedy output."""

import argparse
import sys
from pathlib import Path
from typing import List

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from ..checkpoints import load_drafter
from ..confidence.calibrate import encode, read_prompts
from ..speculative.engine import speculative_generate_step
from ..speculative.stats import SpeculativeStats


def evaluate(model, tokenizer, drafter, prompts: List[List[int]], max_tokens: int, check: bool = True) -> dict:
    """τ over all rounds (tokens per target forward), and how many outputs
    equal plain greedy decoding (when ``check``)."""
    rounds = produced = lossless = 0
    for ids in prompts:
        stats = SpeculativeStats(drafter.name, drafter.block_size)
        tokens = [
            t
            for t, _, _ in speculative_generate_step(
                mx.array(ids), model, drafter, max_tokens=max_tokens,
                stop_tokens=tokenizer.eos_token_ids, stats=stats,
            )
        ]
        rounds += stats.rounds
        produced += sum(r.acceptance_length for r in stats.history)
        if check:
            greedy = []
            for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
                greedy.append(int(t))
                if t in tokenizer.eos_token_ids:
                    break
            lossless += greedy == tokens
    return {"tau": produced / max(rounds, 1), "rounds": rounds,
            "prompts": len(prompts), "lossless": lossless if check else None}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark evaluate",
        description="Report the acceptance length tau of drafters on prompts (greedy).",
    )
    p.add_argument("--model", required=True, help="the target model")
    p.add_argument("--draft-model", required=True, nargs="+", help="one or more drafters")
    p.add_argument("--data", required=True, type=Path, help="prompts (JSONL or text)")
    p.add_argument("--num-prompts", type=int, help="use the first N prompts")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--no-check", action="store_true", help="skip the plain greedy comparison")
    p.add_argument("--ignore-chat-template", action="store_true")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        model, tokenizer = load(args.model)
        prompts = read_prompts(args.data)[: args.num_prompts]
        encoded = [encode(tokenizer, p, not args.ignore_chat_template) for p in prompts]
        for path in args.draft_model:
            r = evaluate(model, tokenizer, load_drafter(path), encoded, args.max_tokens, not args.no_check)
            check = "" if r["lossless"] is None else f", lossless {r['lossless']}/{r['prompts']}"
            print(f"{path}: tau {r['tau']:.3f} over {r['rounds']} rounds, {r['prompts']} prompts{check}")
    except ValueError as e:
        print(f"mlx_dspark evaluate: error: {e}", file=sys.stderr)
        return 1
    return 0
