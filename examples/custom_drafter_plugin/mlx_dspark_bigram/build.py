"""Build a bigram drafter for a target: its greedy next token after each
single token of the vocabulary.

    python -m mlx_dspark_bigram.build --model TARGET --out DIR
"""

import argparse
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from .drafter import save


def next_tokens(model, vocab_size: int, chunk: int = 1024) -> mx.array:
    table = []
    for start in range(0, vocab_size, chunk):
        tokens = mx.arange(start, min(start + chunk, vocab_size))[:, None]
        table.append(mx.argmax(model(tokens)[:, -1], axis=-1).astype(mx.uint32))
        mx.eval(table[-1])
    return mx.concatenate(table)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="the target (path or Hub id)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args()
    model, _ = load(args.model)
    vocab_size = model.args.vocab_size
    save(args.out, next_tokens(model, vocab_size), args.block_size)
    print(f"Wrote a bigram drafter for {args.model} to {args.out}")


if __name__ == "__main__":
    main()
