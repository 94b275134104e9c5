"""``mlx_dspark train``: train a DSpark or DFlash drafter for a target on the
data of ``mlx_dspark prepare``. Runs on several processes (and machines)
with ``mlx.launch``, data-parallel."""

import argparse
import sys
from pathlib import Path

from .objective import LossConfig
from .optim import OptimConfig
from .trainer import TrainConfig, Trainer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark train",
        description="Train a DeepSpec drafter (DSpark or DFlash) for a target model.",
    )
    p.add_argument("--model", required=True, help="the target model (path or hub id)")
    p.add_argument("--data", required=True, type=Path, help="the folder of `mlx_dspark prepare`")
    p.add_argument("--out", required=True, type=Path, help="where the drafter and checkpoints go")
    p.add_argument("--variant", choices=["dspark", "dflash"], default="dspark")
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--layers", type=int, default=5, help="drafter decoder layers")
    p.add_argument("--num-anchors", type=int, default=512, help="blocks per sequence")
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--markov-head-type", choices=["vanilla", "gated", "rnn"], default="vanilla")
    p.add_argument("--mask-token-id", type=int, help="default: 4 (Gemma's <mask>)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step, over all processes")
    p.add_argument(
        "--grad-accum", type=int, default=1,
        help="micro-batches per optimizer step (DeepSpec's gradient_accumulation_steps); "
        "each process takes batch-size / grad-accum / processes sequences at a time",
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32",
        help="training dtype: bfloat16 trains as DeepSpec does (bf16 model, float32 AdamW masters) "
        "and saves a bf16 drafter",
    )
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--steps", type=int, help="train this many steps instead of --epochs")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--loss-decay-gamma", type=float, default=4.0)
    p.add_argument("--ce-alpha", type=float, help="default 0.1 (DSpark), 1.0 (DFlash)")
    p.add_argument("--l1-alpha", type=float, help="default 0.9 (DSpark), 0 (DFlash)")
    p.add_argument("--confidence-alpha", type=float, help="default 1.0 (DSpark), 0 (DFlash)")
    p.add_argument("--holdout", type=float, default=0.05, help="share of sequences held out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=0, help="held-out metrics every N steps")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    return p


def config_from(args) -> TrainConfig:
    loss = LossConfig() if args.variant == "dspark" else LossConfig.dflash()
    loss.loss_decay_gamma = args.loss_decay_gamma
    for name, value in (("ce_loss_alpha", args.ce_alpha), ("l1_loss_alpha", args.l1_alpha),
                        ("confidence_head_alpha", args.confidence_alpha)):
        if value is not None:
            setattr(loss, name, value)
    return TrainConfig(
        variant=args.variant,
        block_size=args.block_size,
        layers=args.layers,
        num_anchors=args.num_anchors,
        markov_rank=args.markov_rank,
        markov_head_type=args.markov_head_type,
        mask_token_id=args.mask_token_id,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        dtype=args.dtype,
        epochs=args.epochs,
        steps=args.steps,
        holdout=args.holdout,
        seed=args.seed,
        save_every=args.save_every,
        eval_every=args.eval_every,
        log_every=args.log_every,
        optim=OptimConfig(args.lr, args.warmup_ratio, args.weight_decay, args.max_grad_norm),
        loss=loss,
    )


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        trainer = Trainer(args.model, args.data, args.out, config_from(args),
                          log=lambda s: print(s, file=sys.stderr, flush=True))
        out = trainer.run(resume=args.resume)
    except ValueError as e:
        print(f"mlx_dspark train: error: {e}", file=sys.stderr)
        return 1
    if trainer.rank == 0:
        print(f"Saved the drafter to {out}", file=sys.stderr)
    return 0
