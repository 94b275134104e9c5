"""Train drafters from scratch on the bundled tiny Gemma-4 target with the
recipe of the bundled drafters (DeepSpec's trainer: block 4, 2 layers, taps
[1,2,4], 16 anchors, Markov rank 16, 300 steps, 128 target answers at T=1),
then compare τ with the bundled drafters on held-out prompts.

Reports training time and tokens/s (sequence tokens through the trainer per
second) and writes one JSON line per variant.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from mlx_lm import load

from mlx_dspark import load_drafter
from mlx_dspark.confidence.calibrate import encode, read_prompts
from mlx_dspark.training.evaluate import evaluate
from mlx_dspark.training.prepare import prepare
from mlx_dspark.training.train import config_from, parser as train_parser
from mlx_dspark.training.trainer import Trainer, global_batch

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"
TARGET = TINY / "target_tiny_gemma4"


def random_prompts(path: Path, count: int, seed: int) -> Path:
    """Prompts of 8 to 24 random words of the tiny vocabulary (ids 5..511)."""
    rng = random.Random(seed)
    lines = [" ".join(f"w{rng.randint(5, 511)}" for _ in range(rng.randint(8, 24))) for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--work", type=Path, help="keep data and drafters here")
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--held-out", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--variants", default="dspark,dflash")
    p.add_argument("--out", type=Path, help="append JSON lines here")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="mlx-dspark-train-"))
    work.mkdir(parents=True, exist_ok=True)

    tic = time.perf_counter()
    prepare(str(TARGET), random_prompts(work / "train.txt", args.sequences, 0), work / "data",
            taps=[1, 2, 4], max_tokens=args.max_tokens, temperature=1.0, chat_template=False)
    prepare_s = time.perf_counter() - tic
    model, tokenizer = load(str(TARGET))
    held = [encode(tokenizer, q, False) for q in read_prompts(random_prompts(work / "held.txt", args.held_out, 1))]

    for variant in args.variants.split(","):
        flags = (f"--model {TARGET} --data {work / 'data'} --out {work / variant} --variant {variant} "
                 f"--block-size 4 --layers 2 --num-anchors 16 --markov-rank 16 --batch-size {args.batch_size} "
                 f"--steps {args.steps} --lr {args.lr} --holdout 0 --log-every 50").split()
        trainer = Trainer(str(TARGET), work / "data", work / variant, config_from(train_parser().parse_args(flags)),
                          log=lambda s: print(s, file=sys.stderr, flush=True))
        tokens = sum(len(trainer.sequences[i].input_ids) for s in range(trainer.total_steps)
                     for i in global_batch(trainer.train_ids, trainer.config, s))
        tic = time.perf_counter()
        trainer.run()
        train_s = time.perf_counter() - tic
        ours = evaluate(model, tokenizer, load_drafter(work / variant), held, args.max_tokens)
        bundled = evaluate(model, tokenizer, load_drafter(TINY / f"{variant}_tiny_gemma4_block4"), held, args.max_tokens)
        row = {
            "benchmark": "train-tiny", "variant": variant, "steps": trainer.total_steps,
            "batch_size": args.batch_size, "lr": args.lr, "sequences": args.sequences, "prepare_s": round(prepare_s, 1),
            "train_s": round(train_s, 1), "tokens_per_s": round(tokens / train_s),
            "tau_trained": round(ours["tau"], 3), "tau_bundled": round(bundled["tau"], 3),
            "tau_ratio": round(ours["tau"] / bundled["tau"], 3),
            "lossless": f"{ours['lossless']}/{ours['prompts']}", "held_out_prompts": len(held),
        }
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
