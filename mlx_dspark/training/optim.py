"""DeepSpec's optimizer (``deepspec/utils/optim.py:BF16Optimizer``): AdamW on
float32 master copies of the trainable parameters, which are copied back to
the model in its training dtype after each step; a linear warmup then cosine
decay; and the gradient clipping of ``FSDP.clip_grad_norm_`` before each
step."""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_map, tree_reduce


@dataclass
class OptimConfig:
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    total_steps: int = 100

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_ratio * self.total_steps)


def learning_rate(config: OptimConfig, step) -> mx.array:
    """The rate of the update after ``step`` updates (``CosineAnnealingWarmupLR``:
    ``lr·t/warmup`` for update ``t = step + 1 <= warmup``, then cosine from
    ``lr`` to 0 over ``total - warmup`` updates, starting again at ``lr``)."""
    warmup = config.warmup_steps
    step = mx.array(step, mx.float32)
    span = max(config.total_steps - warmup, 1)
    cosine = config.lr * 0.5 * (1 + mx.cos(math.pi * (step - warmup) / span))
    return mx.where(step < warmup, config.lr * (step + 1) / max(warmup, 1), cosine)


def make_optimizer(config: OptimConfig) -> optim.AdamW:
    # torch.optim.AdamW's defaults: betas (0.9, 0.999), eps 1e-8.
    return optim.AdamW(
        learning_rate=lambda step: learning_rate(config, step),
        betas=[0.9, 0.999],
        eps=1e-8,
        weight_decay=config.weight_decay,
        bias_correction=True,
    )


def freeze_target_copies(model) -> None:
    """The target's embedding and ``lm_head`` (copied into the drafter) and
    the ``layer_scalar`` buffers are not trained."""
    model.embed_tokens.freeze()
    model.lm_head.freeze()
    for layer in model.layers:
        if "layer_scalar" in layer:
            layer.freeze(keys=["layer_scalar"], recurse=False)


def average_gradients(grads):
    """The mean of every process's gradients (``mx.distributed``); a no-op
    for one process."""
    group = mx.distributed.init()
    if group.size() == 1:
        return grads
    return tree_map(lambda g: mx.distributed.all_sum(g, group=group) / group.size(), grads)


def clip(grads, max_norm: float):
    """``FSDP.clip_grad_norm_``: the norm of all gradients in float32, then
    every gradient times ``min(1, max/(norm+1e-6))`` in its own dtype.
    Returns the clipped gradients, the norm and the coefficient."""
    squares = tree_reduce(lambda total, g: total + mx.square(g.astype(mx.float32)).sum(), grads, 0.0)
    norm = mx.sqrt(squares)
    coef = mx.minimum(max_norm / (norm + 1e-6), 1.0)
    return tree_map(lambda g: g * coef.astype(g.dtype), grads), norm, coef


def master_copy(model):
    """Float32 copies of the trainable parameters (``BF16Optimizer``'s
    ``fp32_params``): the optimizer updates these."""
    return tree_map(lambda p: p.astype(mx.float32), model.trainable_parameters())


def step(optimizer, model, master, grads):
    """One AdamW step on the float32 ``master`` with ``grads`` (cast to
    float32), then the model takes the new masters in its own dtype.
    Returns the new masters."""
    master = optimizer.apply_gradients(tree_map(lambda g: g.astype(mx.float32), grads), master)
    dtypes = tree_map(lambda p: p.dtype, model.trainable_parameters())
    model.update(tree_map(lambda p, d: p.astype(d), master, dtypes))
    return master
