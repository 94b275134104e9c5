"""DeepSpec's training forward and loss (``Gemma4DSparkModel.forward``,
``deepspec/modeling/dspark/loss.py:compute_dspark_loss``).

Slot ``k`` of every block weighs ``w_k = eval_mask · exp(-k/γ)``. With
``p_d`` the drafter's distribution (Markov-corrected) and ``p_t`` the
target's at the same position, read through the drafter's frozen
``lm_head``:

    CE   = Σ w · (-log p_d[label])       / (Σ w + 1e-6)
    L1   = Σ w · ‖p_d - p_t‖₁            / (Σ w + 1e-6)
    BCE  = Σ w · bce(c, 1 - ½‖p_d - p_t‖₁) / (Σ w + 1e-6)
    loss = α_ce · CE + α_l1 · L1 + α_conf · BCE

A term with ``α = 0`` is skipped. ``Σ w`` is over the global batch (all
processes), so per-process losses add up to the global one.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from .blocks import Blocks


@dataclass
class LossConfig:
    loss_decay_gamma: float = 4.0
    ce_loss_alpha: float = 0.1
    l1_loss_alpha: float = 0.9
    confidence_head_alpha: float = 1.0

    @classmethod
    def dflash(cls) -> "LossConfig":
        return cls(ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0)


@dataclass
class Outputs:
    """The training forward of a batch: ``[b, n, B, ...]``."""

    hidden: mx.array
    logits: mx.array
    confidence: Optional[mx.array]


def forward(model, blocks: Blocks, features: mx.array) -> Outputs:
    """Draft logits (soft-capped, then Markov-corrected with the teacher-forced
    previous tokens) and confidence logits of every block."""
    b, n, B = blocks.labels.shape
    mask, keep = blocks.attention_mask()
    hidden = model.forward_blocks(blocks.inputs, features, blocks.anchors, mask, keep)
    hidden = hidden.reshape(b, n, B, -1)
    logits = model.compute_logits(hidden)
    head = model.markov_head
    embeddings = None
    if head is not None:
        embeddings = head.markov_w1(blocks.prev)
        state = head.initial_state(hidden)
        biases = []
        for k in range(B):
            bias, state = head.step(embeddings[:, :, k], hidden[:, :, k], state)
            biases.append(bias)
        logits = logits + mx.stack(biases, axis=2)
    confidence = None
    if model.confidence_head is not None:
        features = hidden
        if model.args.confidence_head_with_markov:
            features = mx.concatenate([hidden, embeddings.astype(hidden.dtype)], -1)
        confidence = model.confidence_head(features).astype(mx.float32)
    return Outputs(hidden, logits, confidence)


def slot_weights(blocks: Blocks, gamma: float) -> mx.array:
    B = blocks.labels.shape[-1]
    decay = mx.exp(-mx.arange(B, dtype=mx.float32) / gamma)
    return blocks.eval_mask.astype(mx.float32) * decay


def target_probs(model, blocks: Blocks, last_hidden: mx.array) -> mx.array:
    """``p_t``: the target's final-normed hidden state at each label's
    position, through the drafter's frozen ``lm_head`` (and soft-cap)."""
    rows = mx.arange(last_hidden.shape[0])[:, None, None]
    logits = model.compute_logits(last_hidden[rows, blocks.aligned])
    return mx.stop_gradient(mx.softmax(logits.astype(mx.float32), axis=-1))


def token_terms(outputs: Outputs, blocks: Blocks, p_target: mx.array) -> Dict[str, mx.array]:
    """The per-slot terms ``[b, n, B]``: ``ce``, ``l1``, ``accept`` (the
    confidence target ``c*``) and, with a confidence head, ``bce``."""
    logits = outputs.logits.astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -mx.take_along_axis(log_probs, blocks.labels[..., None], axis=-1)[..., 0]
    l1 = mx.abs(mx.exp(log_probs) - p_target).sum(-1)
    accept = mx.stop_gradient(mx.clip(1 - 0.5 * l1, 0, 1))
    terms = {"ce": ce, "l1": l1, "accept": accept}
    if outputs.confidence is not None:
        terms["bce"] = nn.losses.binary_cross_entropy(
            outputs.confidence, accept, with_logits=True, reduction="none"
        )
    return terms


def weight_sum(blocks: Blocks, config: LossConfig) -> mx.array:
    return slot_weights(blocks, config.loss_decay_gamma).sum()


def loss(
    model,
    blocks: Blocks,
    features: mx.array,
    last_hidden: mx.array,
    config: LossConfig,
    total_weight: Optional[mx.array] = None,
):
    """DeepSpec's loss on a batch and its terms. ``total_weight`` is ``Σ w``
    over the global batch (this batch's by default)."""
    outputs = forward(model, blocks, features)
    terms = token_terms(outputs, blocks, target_probs(model, blocks, last_hidden))
    weights = slot_weights(blocks, config.loss_decay_gamma)
    if total_weight is None:
        total_weight = weights.sum()
    den = total_weight + 1e-6
    parts = {"ce": (weights * terms["ce"]).sum() / den}
    total = config.ce_loss_alpha * parts["ce"]
    if config.l1_loss_alpha > 0:
        parts["l1"] = (weights * terms["l1"]).sum() / den
        total = total + config.l1_loss_alpha * parts["l1"]
    if config.confidence_head_alpha > 0 and "bce" in terms:
        parts["confidence"] = (weights * terms["bce"]).sum() / den
        total = total + config.confidence_head_alpha * parts["confidence"]
    return total, (parts, terms, outputs)
