"""Sampled speculative decoding through the Python API: temperature, top-p,
penalties and logit bias, with the acceptance rule each sampler gets and τ.

The output has exactly the target's distribution under these settings:
`mlx_dspark.make_sampler` (mlx-lm's make_sampler with its settings attached)
gets rejection sampling; any other sampler callable gets target-sample
matching; no sampler is greedy.
"""

import argparse
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.sample_utils import make_logits_processors

import mlx_dspark

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument("--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4"))
    parser.add_argument("--prompt", default="w65 w211 w266 w241 w234 w10 w325")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temp", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repetition-penalty", type=float, default=1.1)
    parser.add_argument("--presence-penalty", type=float, default=0.2)
    parser.add_argument("--frequency-penalty", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    drafter = mlx_dspark.load_drafter(args.draft_model)
    # Discourage the prompt's last token (a logit bias is {token id: bias}).
    biased = tokenizer.encode(args.prompt)[-1]
    processors = make_logits_processors(
        logit_bias={biased: -5.0},
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    known = mlx_dspark.make_sampler(temp=args.temp, top_p=args.top_p)
    samplers = {
        "none (greedy)": None,
        "mlx_dspark.make_sampler": known,
        "an opaque callable": lambda logprobs: known(logprobs),
    }
    for name, sampler in samplers.items():
        mx.random.seed(args.seed)
        text = ""
        for response in mlx_dspark.stream_generate(
            model, tokenizer, args.prompt, draft=drafter,
            max_tokens=args.max_tokens, sampler=sampler, logits_processors=processors,
        ):  # fmt: skip
            text += response.text
        stats = response.stats
        print(f"sampler: {name}")
        print(f"  acceptance rule: {stats.acceptance_rule}, tau {stats.tau:.2f}")
        print(f"  text: {text[:100]}")


if __name__ == "__main__":
    main()
