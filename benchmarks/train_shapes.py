"""Training speed and memory of ``mlx_dspark train`` at Gemma-4-12B drafter
shapes (or scaled down), on random data.

The drafter is the released one's geometry (``shapes.drafter_config``: five
layers of 3840, five taps, block 7, 512 anchors, the 262144-word embedding
and head copied from the target and frozen). The trainer reads only the
target's config, embedding and head, so the target written to disk keeps the
12B widths and vocabulary but only one group of six layers (the taps are
layers 0-4); the drafter's shapes do not depend on the target's depth.
Sequences are random tokens with random bf16 features; a quarter of each is
prompt (no loss). Weights, data and losses mean nothing: only time and memory.

Each configuration runs in a process of its own (so its peak memory is its
own): ``--warmup`` optimizer steps (compilation), then ``--steps`` timed ones
through ``Trainer.train_step``. It reports tokens/s (sequence tokens through
the trainer, as ``train`` logs them) and MLX's peak memory. One JSON line per
configuration.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_dspark.training import data
from mlx_dspark.training.train import config_from, parser as train_parser
from mlx_dspark.training.trainer import Trainer
from timing import backend
from write_shapes import write_target

TAPS = [0, 1, 2, 3, 4]


def write_data(folder: Path, config: dict, sequences: int, length: int, seed: int = 0) -> None:
    """Random sequences in ``prepare``'s format, one shard."""
    rng = np.random.default_rng(seed)
    d, prompt = config["hidden_size"], length // 4
    rows = []
    for _ in range(sequences):
        mask = np.ones(length, np.uint8)
        mask[:prompt] = 0
        rows.append({
            "input_ids": rng.integers(5, config["vocab_size"], length).tolist(),
            "loss_mask": mask.tolist(),
            "hidden": mx.random.normal((length, len(TAPS) * d)).astype(mx.bfloat16),
            "last_hidden": mx.random.normal((length, d)).astype(mx.bfloat16),
        })
    folder.mkdir(parents=True, exist_ok=True)
    data.write_shard(folder, 0, rows)
    meta = {
        "model": "random", "family": "gemma4", "target_layer_ids": TAPS, "num_target_layers": 6,
        "hidden_size": d, "vocab_size": config["vocab_size"], "max_tokens": length - prompt,
    }
    (folder / data.META).write_text(json.dumps(meta))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per optimizer step")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (DeepSpec: 1 sequence each)")
    p.add_argument("--num-anchors", type=int, default=512)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--variants", nargs="+", default=["dspark", "dflash"])
    p.add_argument("--work", type=Path, help="keep the target and data here")
    p.add_argument("--out", type=Path, help="append JSON lines here")
    args = p.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="mlx-dspark-train-shapes-"))
    if not (work / "data" / data.META).exists():
        mx.random.seed(0)
        config = write_target(work / "target", args.scale, layers=6)
        write_data(work / "data", config, args.batch_size * (args.warmup + args.steps), args.seq_len)
    configurations = [(v, d) for v in args.variants for d in args.dtypes]
    if len(configurations) > 1:
        for variant, dtype in configurations:
            subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--work", str(work), "--variants", variant, "--dtypes", dtype],
                check=True,
            )
        return
    [(variant, dtype)] = configurations
    row = measure(work, variant, dtype, args)
    print(json.dumps(row), flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def measure(work: Path, variant: str, dtype: str, args) -> dict:
    flags = (
        f"--model {work / 'target'} --data {work / 'data'} --out {work / variant} --variant {variant} "
        f"--block-size 7 --layers 5 --num-anchors {args.num_anchors} --markov-rank {256 // args.scale} "
        f"--batch-size {args.batch_size} --grad-accum {args.grad_accum} --dtype {dtype} "
        f"--steps {args.warmup + args.steps} --holdout 0"
    ).split()
    trainer = Trainer(str(work / "target"), work / "data", work / variant,
                      config_from(train_parser().parse_args(flags)), log=lambda *_: None)
    mx.reset_peak_memory()
    for step in range(args.warmup):
        trainer.train_step(step)
    tokens, tic = 0.0, time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        tokens += trainer.train_step(step)["tokens"].item()
    seconds = time.perf_counter() - tic
    trainable = sum(v.size for _, v in tree_flatten(trainer.model.trainable_parameters()))
    return {
        "benchmark": "train-shapes", "variant": variant, "dtype": dtype,
        "shapes": f"gemma-4-12b drafter/{args.scale}", "trainable_params": trainable,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
        "num_anchors": args.num_anchors, "timed_steps": args.steps,
        "s_per_step": round(seconds / args.steps, 3), "tokens_per_s": round(tokens / seconds),
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 2),
        "backend": backend(), "mlx": mx.__version__,
    }


if __name__ == "__main__":
    main()
