"""Speculative decoding with a DSpark drafter on the tiny Gemma-4 pair bundled
with the project (no download): prints the text, the speculative statistics,
and checks the output against plain greedy decoding."""

import argparse
from pathlib import Path

from mlx_lm import load
from mlx_lm import stream_generate as mlx_lm_stream_generate

import mlx_dspark

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument(
        "--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4")
    )
    parser.add_argument(
        "--prompt", default="w65 w211 w266 w241 w234 w10 w325 w168 w387 w454"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--confidence-threshold", type=float, default=0.0)
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    drafter = mlx_dspark.load_drafter(
        args.draft_model, confidence_threshold=args.confidence_threshold
    )
    print(f"target: {args.model}\ndrafter: {drafter}\n")

    tokens = []
    for response in mlx_dspark.stream_generate(
        model, tokenizer, args.prompt, draft=drafter, max_tokens=args.max_tokens
    ):
        print(response.text, end="", flush=True)
        tokens.append(response.token)
    print("\n")
    print(f"speculative: {response.generation_tps:.1f} tokens/s")
    print(response.stats.summary())

    plain = [
        r.token
        for r in mlx_lm_stream_generate(
            model, tokenizer, args.prompt, max_tokens=args.max_tokens
        )
    ]
    print(f"identical to plain greedy decoding: {tokens == plain}")


if __name__ == "__main__":
    main()
