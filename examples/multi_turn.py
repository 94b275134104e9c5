"""A multi-turn conversation with one prompt cache for target and drafter
(`mlx_dspark.make_prompt_cache`), running past the target's sliding window.

Each turn sends only its new tokens; the cache holds the conversation so far.
Every reply is checked against plain greedy decoding of the whole
conversation, which mlx-lm's own speculative decoding gets wrong once the
sliding window has filled.
"""

import argparse
from pathlib import Path

from mlx_lm import load
from mlx_lm import stream_generate as mlx_lm_stream_generate

import mlx_dspark

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"
TURNS = ["w65 w211 w266 w241", "w234 w10 w325 w168", "w387 w454 w12 w99 w7"]


def encode(tokenizer, message: str) -> list:
    """A user turn as mlx-lm's chat does it: the chat template of the new
    message alone, or its plain tokens without a template."""
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True
        )
    return tokenizer.encode(message)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument("--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4"))
    parser.add_argument("--turn", action="append", help="a user message (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    drafter = mlx_dspark.load_drafter(args.draft_model)
    window = getattr(model.args, "sliding_window", None)
    cache = mlx_dspark.make_prompt_cache(model, drafter)
    conversation = []
    for number, message in enumerate(args.turn or TURNS, 1):
        prompt = encode(tokenizer, message)
        reply = [
            r.token
            for r in mlx_dspark.stream_generate(
                model, tokenizer, prompt, draft=drafter,
                max_tokens=args.max_tokens, prompt_cache=cache,
            )  # fmt: skip
        ]
        plain = [
            r.token
            for r in mlx_lm_stream_generate(
                model, tokenizer, conversation + prompt, max_tokens=args.max_tokens
            )
        ]
        conversation += prompt + reply
        print(f"turn {number}: {message}")
        print(f"  reply: {tokenizer.decode(reply)}")
        print(
            f"  context {len(conversation)} tokens (sliding window {window}), "
            f"identical to plain decoding: {reply == plain}"
        )


if __name__ == "__main__":
    main()
