"""The training loop: DeepSpec's trainer (``deepspec/trainer``) on prepared
data, data-parallel through ``mx.distributed``.

Each optimizer step takes ``batch_size`` sequences (the global batch) in
``grad_accum`` micro-batches; with several processes each takes every
``world``-th sequence of a micro-batch. Each sequence's anchors come from a
generator seeded by (seed, step, sequence). As in DeepSpec, a micro-batch's
loss is normalised by ``Σ w`` of that micro-batch over all processes (not
over the micro-batches of the step) and divided by ``grad_accum``, so the
step follows the mean of the micro-batches' losses. The step is a pure
function of (parameters, optimizer state, step), so a run resumed from a
checkpoint and a run on several processes give the parameters of one
uninterrupted process.

With ``dtype="bfloat16"`` the model (frozen copies included) runs forward
and backward in bf16, gradients are accumulated, all-reduced and clipped in
bf16, and AdamW updates float32 masters that are copied back to the bf16
model: DeepSpec's ``precision="bf16"`` (the model cast to bf16, FSDP
``MixedPrecision(param_dtype=bf16)``, ``BF16Optimizer``).
"""

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten

from ..validation import check
from . import data, drafter, objective, optim
from .blocks import make_blocks, sample_anchors
from .objective import LossConfig
from .optim import OptimConfig

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer.safetensors"
MASTER_WEIGHTS = "master.safetensors"
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


@dataclass
class TrainConfig:
    variant: str = "dspark"
    block_size: int = 7
    layers: int = 5
    num_anchors: int = 512
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    mask_token_id: Optional[int] = None
    batch_size: int = 16
    grad_accum: int = 1
    dtype: str = "float32"
    epochs: int = 10
    steps: Optional[int] = None
    holdout: float = 0.05
    seed: int = 0
    save_every: int = 0
    eval_every: int = 0
    log_every: int = 10
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        d["optim"] = OptimConfig(**d["optim"])
        d["loss"] = LossConfig(**d["loss"])
        return cls(**d)


def split(count: int, holdout: float, seed: int):
    """Sequence indices to train on and to hold out (at least one each)."""
    order = np.random.default_rng([seed, 1]).permutation(count)
    held = min(max(math.ceil(count * holdout), 1), count - 1) if holdout > 0 else 0
    return sorted(order[held:].tolist()), sorted(order[:held].tolist())


def steps_per_epoch(train_count: int, batch_size: int) -> int:
    return max(train_count // batch_size, 1)


def global_batch(train: List[int], config: TrainConfig, step: int) -> List[int]:
    """The sequences of ``step``: epoch ``e`` visits ``train`` in a
    permutation seeded by (seed, e), dropping the last partial batch."""
    per_epoch = steps_per_epoch(len(train), config.batch_size)
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([config.seed, 2, epoch]).permutation(len(train))
    chosen = order[index * config.batch_size : (index + 1) * config.batch_size]
    return [train[i] for i in chosen]


def micro_batches(indices: List[int], config: TrainConfig, rank: int, world: int) -> List[List[int]]:
    """This process's sequences of each micro-batch of a step's global batch."""
    size = len(indices) // config.grad_accum
    return [indices[start : start + size][rank::world] for start in range(0, len(indices), size)]


def batch_blocks(sequences, indices, config: TrainConfig, args, stream):
    """The padded batch and its blocks; each sequence's anchors come from a
    generator of its own, seeded by (seed, *stream, sequence index)."""
    batch = data.collate([sequences[i] for i in indices], DTYPES[config.dtype])
    mask = np.array(batch["loss_mask"])
    picks = [
        sample_anchors(mask[row : row + 1], config.num_anchors, np.random.default_rng([config.seed, *stream, i]))
        for row, i in enumerate(indices)
    ]
    anchors = mx.array(np.concatenate([a for a, _ in picks]))
    keep = mx.array(np.concatenate([k for _, k in picks]))
    blocks = make_blocks(
        batch["input_ids"], batch["loss_mask"], anchors, keep, args.block_size, args.mask_token_id
    )
    return batch, blocks


def validate(config: TrainConfig, world: int) -> None:
    check(config.batch_size, "batch_size", "integer", 1)
    check(config.grad_accum, "grad_accum", "integer", 1)
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}.")
    if config.batch_size % config.grad_accum:
        raise ValueError(
            f"batch_size ({config.batch_size}) must be a multiple of grad_accum "
            f"({config.grad_accum}): each step takes grad_accum micro-batches of the same size."
        )
    if config.batch_size // config.grad_accum < world:
        raise ValueError(
            f"A micro-batch (batch_size / grad_accum = {config.batch_size // config.grad_accum}) "
            f"must hold at least one sequence for each of the {world} processes."
        )


def acceptance(terms: dict, blocks) -> dict:
    """Per-slot survival of the confidence target ``c*`` (DeepSpec's
    ``accept_rate@k``: ``Π_{i<=k} c*_i`` over the slots that count) and the
    expected acceptance length ``1 + Σ_k`` of it per kept block."""
    evaluated = blocks.eval_mask.astype(mx.float32)
    survival = mx.cumprod(terms["accept"], axis=-1) * evaluated
    blocks_kept = blocks.keep.astype(mx.float32).sum()
    return {
        "survival_sum": survival.sum(axis=(0, 1)),
        "slot_count": evaluated.sum(axis=(0, 1)),
        "blocks": blocks_kept,
        "length_sum": blocks_kept + survival.sum(),
    }


class Trainer:
    def __init__(self, target_path: str, data_dir: Path, out: Path, config: TrainConfig, log: Callable = print):
        from mlx_lm import load

        self.group = mx.distributed.init()
        self.rank, self.world = self.group.rank(), self.group.size()
        self.out, self.config = out, config
        validate(config, self.world)
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        self.meta = data.read_meta(data_dir)
        self.sequences = data.read_sequences(data_dir)
        if len(self.sequences) < 2:
            raise ValueError(f"{data_dir} holds {len(self.sequences)} sequences; training needs at least 2.")
        self.train_ids, self.held_ids = split(len(self.sequences), config.holdout, config.seed)
        if len(self.train_ids) < config.batch_size:
            raise ValueError(
                f"{len(self.train_ids)} training sequences do not make one batch of "
                f"{config.batch_size} (batch_size); lower it or prepare more data."
            )
        self.total_steps = config.steps or config.epochs * steps_per_epoch(len(self.train_ids), config.batch_size)
        config.optim.total_steps = self.total_steps

        from ..checkpoints import read_config, resolve_checkpoint

        target_dir = resolve_checkpoint(target_path)
        self.drafter_config = drafter.drafter_config(
            read_config(target_dir),
            self.meta["family"],
            self.meta["target_layer_ids"],
            block_size=config.block_size,
            num_layers=config.layers,
            mask_token_id=config.mask_token_id,
            num_anchors=config.num_anchors,
            markov_rank=config.markov_rank if config.variant == "dspark" else 0,
            markov_head_type=config.markov_head_type,
            confidence_head=config.variant == "dspark" and config.loss.confidence_head_alpha > 0,
            dtype=config.dtype,
        )
        target_model, _ = load(str(target_dir))
        self.model = drafter.build(self.drafter_config, self.meta["family"], target_model, config.seed)
        del target_model
        optim.freeze_target_copies(self.model)
        # DeepSpec casts the model before copying the masters, so they start
        # from the bf16-rounded initialisation.
        self.model.set_dtype(DTYPES[config.dtype])
        self.master = optim.master_copy(self.model)
        self.optimizer = optim.make_optimizer(config.optim)
        self.step = 0
        self.value_and_grad = nn.value_and_grad(self.model, self._loss)

    @property
    def args(self):
        return self.model.args

    def _loss(self, batch, blocks, total_weight):
        loss, (parts, terms, _) = objective.loss(
            self.model, blocks, batch["hidden"], batch["last_hidden"], self.config.loss, total_weight
        )
        # DeepSpec multiplies by the world size (the gradients are averaged)
        # and divides by the accumulation steps before each backward.
        return loss * self.world / self.config.grad_accum, (parts, terms)

    def micro_step(self, indices: List[int], step: int):
        """The gradients of one micro-batch (this process's ``indices``) and
        its metrics: loss terms normalised over the micro-batch, divided by
        ``grad_accum``, and acceptance sums."""
        batch, blocks = batch_blocks(self.sequences, indices, self.config, self.args, (3, step))
        total_weight = objective.weight_sum(blocks, self.config.loss)
        if self.world > 1:
            total_weight = mx.distributed.all_sum(total_weight, group=self.group)
        (_, (parts, terms)), grads = self.value_and_grad(batch, blocks, total_weight)
        metrics = {k: v / self.config.grad_accum for k, v in parts.items()}
        metrics.update(acceptance(terms, blocks))
        metrics["tokens"] = mx.array(batch["input_ids"].size, mx.float32)
        return grads, metrics

    def gradients(self, step: int):
        """The gradients of optimizer step ``step`` (the sum of its micro-
        batches' gradients in the training dtype, averaged over processes)
        and its metrics over all processes."""
        indices = global_batch(self.train_ids, self.config, step)
        grads, metrics = None, {}
        for mine in micro_batches(indices, self.config, self.rank, self.world):
            g, m = self.micro_step(mine, step)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            metrics = {k: metrics.get(k, 0) + v for k, v in m.items()}
            mx.eval(grads, metrics)
        if self.world > 1:
            metrics = {k: mx.distributed.all_sum(v, group=self.group) for k, v in metrics.items()}
        return optim.average_gradients(grads), metrics

    def train_step(self, step: int) -> dict:
        """Optimizer step ``step``: gradients, clipping, then AdamW."""
        grads, metrics = self.gradients(step)
        grads, norm, coef = optim.clip(grads, self.config.optim.max_grad_norm)
        lr = optim.learning_rate(self.config.optim, step)
        self.master = optim.step(self.optimizer, self.model, self.master, grads)
        mx.eval(self.model.parameters(), self.master, self.optimizer.state, metrics)
        metrics.update(grad_norm=norm, clip_coef=coef, lr=lr)
        return metrics

    def evaluate(self) -> Optional[dict]:
        """The loss terms and acceptance on the held-out sequences."""
        if not self.held_ids:
            return None
        mine = self.held_ids[self.rank :: self.world]
        totals = {}
        size = self.config.batch_size // self.config.grad_accum
        for start in range(0, len(mine), size):
            indices = mine[start : start + size]
            batch, blocks = batch_blocks(self.sequences, indices, self.config, self.args, (4,))
            weight = objective.weight_sum(blocks, self.config.loss)
            _, (parts, terms, _) = objective.loss(
                self.model, blocks, batch["hidden"], batch["last_hidden"], self.config.loss, mx.array(1.0)
            )
            found = {f"{k}_sum": v for k, v in parts.items()}
            found.update(acceptance(terms, blocks), weight=weight)
            for k, v in found.items():
                totals[k] = totals.get(k, 0) + v
        if self.world > 1:
            totals = {k: mx.distributed.all_sum(v, group=self.group) for k, v in totals.items()}
        return summarize(totals)

    def run(self, resume: bool = False) -> Path:
        if resume:
            self.restore(latest_checkpoint(self.out))
        self.log(
            f"Training a {self.config.variant} drafter: {len(self.train_ids)} sequences "
            f"({len(self.held_ids)} held out), {self.total_steps} steps of {self.config.batch_size} "
            f"in {self.config.grad_accum} micro-batch(es), {self.config.dtype}, "
            f"{self.world} process(es), from step {self.step}"
        )
        tic, tokens = time.perf_counter(), 0.0
        while self.step < self.total_steps:
            metrics = self.train_step(self.step)
            self.step += 1
            tokens += metrics["tokens"].item()
            last = self.step == self.total_steps
            if self.config.log_every and (self.step % self.config.log_every == 0 or last):
                elapsed = time.perf_counter() - tic
                self.log(format_metrics(self.step, self.total_steps, metrics, tokens / elapsed))
                tic, tokens = time.perf_counter(), 0.0
            if self.config.eval_every and (self.step % self.config.eval_every == 0 or last):
                report = self.evaluate()
                if report:
                    self.log(format_eval(self.step, report))
            if self.config.save_every and self.step % self.config.save_every == 0 and not last:
                self.checkpoint()
        if self.rank == 0:
            drafter.save(self.model, self.drafter_config, self.out)
        return self.out

    def checkpoint(self) -> Path:
        """The drafter plus what resuming needs, under ``out/checkpoints``."""
        folder = self.out / CHECKPOINTS / f"step-{self.step:08d}"
        if self.rank == 0:
            drafter.save(self.model, self.drafter_config, folder)
            mx.save_safetensors(str(folder / OPTIMIZER_STATE), dict(tree_flatten(self.optimizer.state)))
            if self.config.dtype != "float32":
                # The drafter is saved in its training dtype; DeepSpec keeps
                # the float32 masters in its training state for resuming.
                mx.save_safetensors(str(folder / MASTER_WEIGHTS), dict(tree_flatten(self.master)))
            state = {"step": self.step, "config": asdict(self.config), "world_size": self.world}
            (folder / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        return folder

    def restore(self, folder: Path) -> None:
        state = json.loads((folder / TRAINER_STATE).read_text())
        saved = TrainConfig.from_dict(state["config"])
        if asdict(saved) != asdict(self.config):
            changed = sorted(k for k, v in asdict(self.config).items() if asdict(saved)[k] != v)
            raise ValueError(f"{folder} was trained with other settings ({', '.join(changed)}).")
        self.model.load_weights(str(folder / "model.safetensors"))
        self.optimizer.state = tree_unflatten(list(mx.load(str(folder / OPTIMIZER_STATE)).items()))
        self.master = optim.master_copy(self.model)
        if self.config.dtype != "float32":
            saved = mx.load(str(folder / MASTER_WEIGHTS))
            self.master = tree_map_with_path(lambda path, _: saved[path], self.master)
        self.step = state["step"]
        mx.eval(self.model.parameters(), self.master, self.optimizer.state)


def latest_checkpoint(out: Path) -> Path:
    folders = sorted((out / CHECKPOINTS).glob("step-*"))
    if not folders:
        raise ValueError(f"{out / CHECKPOINTS} holds no checkpoint to resume from.")
    return folders[-1]


def summarize(totals: dict) -> dict:
    report = {k[:-4]: (v / (totals["weight"] + 1e-6)).item() for k, v in totals.items() if k.endswith("_sum") and k not in ("survival_sum", "length_sum")}
    report["accept_rate"] = (totals["survival_sum"] / mx.maximum(totals["slot_count"], 1)).tolist()
    report["expected_tau"] = (totals["length_sum"] / mx.maximum(totals["blocks"], 1)).item()
    return report


def format_metrics(step: int, total: int, m: dict, tokens_per_second: float) -> str:
    terms = " ".join(f"{k} {m[k].item():.4f}" for k in ("ce", "l1", "confidence") if k in m)
    accept = (m["survival_sum"] / mx.maximum(m["slot_count"], 1)).tolist()
    return (
        f"step {step}/{total}: {terms} | accept@k {' '.join(f'{a:.2f}' for a in accept)} | "
        f"grad norm {m['grad_norm'].item():.3f} lr {m['lr'].item():.2e} | {tokens_per_second:.0f} tok/s"
    )


def format_eval(step: int, report: dict) -> str:
    terms = " ".join(f"{k} {report[k]:.4f}" for k in ("ce", "l1", "confidence") if k in report)
    accept = " ".join(f"{a:.2f}" for a in report["accept_rate"])
    return f"held-out at step {step}: {terms} | accept@k {accept} | expected tau {report['expected_tau']:.2f}"
